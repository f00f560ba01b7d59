const express = require("express");
const crypto = require("crypto");

const app = express();
app.use(express.json({ limit: "1mb" }));

const carts = new Map();
const orders = new Map();
const products = new Map([
  ["tea-green", { name: "Green tea", price: 450, stock: 120 }],
  ["tea-black", { name: "Black tea", price: 420, stock: 80 }],
  ["mug-white", { name: "White mug", price: 900, stock: 35 }],
  ["pot-glass", { name: "Glass teapot", price: 2400, stock: 12 }],
]);

function newId(prefix) {
  return `${prefix}_${crypto.randomBytes(6).toString("hex")}`;
}

function cartTotal(cart) {
  let total = 0;
  for (const [sku, quantity] of cart.items) {
    total += products.get(sku).price * quantity;
  }
  return total;
}

function requireCart(req, res) {
  const cart = carts.get(req.params.cartId);
  if (!cart) {
    res.status(404).json({ error: `no cart ${req.params.cartId}` });
    return null;
  }
  return cart;
}

app.get("/products", (req, res) => {
  const list = [];
  for (const [sku, product] of products) {
    list.push({ sku, ...product });
  }
  res.json(list);
});

app.get("/products/:sku", (req, res) => {
  const product = products.get(req.params.sku);
  if (!product) {
    res.status(404).json({ error: `no product ${req.params.sku}` });
    return;
  }
  res.json({ sku: req.params.sku, ...product });
});

app.post("/carts", (req, res) => {
  const cart = { id: newId("cart"), items: new Map(), created: Date.now() };
  carts.set(cart.id, cart);
  res.status(201).json({ id: cart.id });
});

app.get("/carts/:cartId", (req, res) => {
  const cart = requireCart(req, res);
  if (!cart) return;
  const items = [];
  for (const [sku, quantity] of cart.items) {
    items.push({ sku, quantity, price: products.get(sku).price });
  }
  res.json({ id: cart.id, items, total: cartTotal(cart) });
});

app.post("/carts/:cartId/items", (req, res) => {
  const cart = requireCart(req, res);
  if (!cart) return;
  const { sku, quantity } = req.body;
  const product = products.get(sku);
  if (!product) {
    res.status(400).json({ error: `no product ${sku}` });
    return;
  }
  if (!Number.isInteger(quantity) || quantity <= 0) {
    res.status(400).json({ error: "quantity must be a positive integer" });
    return;
  }
  const wanted = (cart.items.get(sku) || 0) + quantity;
  if (wanted > product.stock) {
    res.status(409).json({ error: `only ${product.stock} of ${sku} in stock` });
    return;
  }
  cart.items.set(sku, wanted);
  res.json({ id: cart.id, total: cartTotal(cart) });
});

app.delete("/carts/:cartId/items/:sku", (req, res) => {
  const cart = requireCart(req, res);
  if (!cart) return;
  cart.items.delete(req.params.sku);
  res.json({ id: cart.id, total: cartTotal(cart) });
});

app.post("/carts/:cartId/checkout", (req, res) => {
  const cart = requireCart(req, res);
  if (!cart) return;
  if (cart.items.size === 0) {
    res.status(400).json({ error: "the cart is empty" });
    return;
  }
  for (const [sku, quantity] of cart.items) {
    if (products.get(sku).stock < quantity) {
      res.status(409).json({ error: `only ${products.get(sku).stock} of ${sku} left` });
      return;
    }
  }
  for (const [sku, quantity] of cart.items) {
    products.get(sku).stock -= quantity;
  }
  const order = {
    id: newId("order"),
    items: Object.fromEntries(cart.items),
    total: cartTotal(cart),
    placed: new Date().toISOString(),
    status: "placed",
  };
  orders.set(order.id, order);
  carts.delete(cart.id);
  res.status(201).json(order);
});

app.get("/orders/:orderId", (req, res) => {
  const order = orders.get(req.params.orderId);
  if (!order) {
    res.status(404).json({ error: `no order ${req.params.orderId}` });
    return;
  }
  res.json(order);
});

app.post("/orders/:orderId/cancel", (req, res) => {
  const order = orders.get(req.params.orderId);
  if (!order) {
    res.status(404).json({ error: `no order ${req.params.orderId}` });
    return;
  }
  if (order.status !== "placed") {
    res.status(409).json({ error: `order is ${order.status}` });
    return;
  }
  for (const [sku, quantity] of Object.entries(order.items)) {
    products.get(sku).stock += quantity;
  }
  order.status = "cancelled";
  res.json(order);
});

const port = Number(process.env.PORT || 3000);
app.listen(port, () => console.log(`store listening on ${port}`));
