const http = require("http");
const fs = require("fs");
const path = require("path");

const PORT = Number(process.env.PORT || 8080);
const ROOT = path.join(__dirname, "public");
const TYPES = {
  ".html": "text/html; charset=utf-8",
  ".css": "text/css",
  ".js": "application/javascript",
  ".json": "application/json",
  ".png": "image/png",
};

let requests = 0;

function send(res, status, body, type = "text/plain") {
  res.writeHead(status, { "Content-Type": type, "Content-Length": Buffer.byteLength(body) });
  res.end(body);
}

function serveFile(req, res) {
  const name = req.url === "/" ? "/index.html" : req.url.split("?")[0];
  const file = path.join(ROOT, path.normalize(name));
  if (!file.startsWith(ROOT)) {
    send(res, 403, "forbidden");
    return;
  }
  fs.readFile(file, (err, data) => {
    if (err) {
      send(res, 404, "not found");
      return;
    }
    const type = TYPES[path.extname(file)] || "application/octet-stream";
    res.writeHead(200, { "Content-Type": type });
    res.end(data);
  });
}

function stats(req, res) {
  const body = JSON.stringify({ requests, uptime: process.uptime() });
  send(res, 200, body, "application/json");
}

const server = http.createServer((req, res) => {
  requests += 1;
  if (req.method !== "GET") {
    send(res, 405, "method not allowed");
    return;
  }
  if (req.url === "/stats") {
    stats(req, res);
    return;
  }
  serveFile(req, res);
});

server.listen(PORT, () => {
  console.log(`listening on http://localhost:${PORT}`);
});
