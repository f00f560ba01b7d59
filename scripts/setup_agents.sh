#!/usr/bin/env bash
# Install the coding agents the tests drive against real ranks (Claude Code, Codex CLI,
# opencode: tests/agents/package.json, pinned, with its lock file) into
# tests/agents/node_modules, only when missing or changed. All three ship on npm; Codex's
# and opencode's native binaries come inside their npm packages.
#
# Needs npm (Node.js 20 or newer). Without it this says so and exits 0:
# tests/test_coding_agents.py then skips, naming what is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="$ROOT/tests/agents"
STAMP="$DIR/node_modules/.installed-lock"

say() { printf '  %s\n' "$*" >&2; }

if ! command -v npm >/dev/null 2>&1; then
    say "npm not found: the coding-agent tests will skip (install Node.js 20+ to run them)"
    exit 0
fi
want="$(cat "$DIR/package-lock.json" "$DIR/package.json" | cksum)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi
say "installing the coding agents (Claude Code, Codex CLI, opencode; about 1 GB, once)"
SECONDS=0
(cd "$DIR" && npm install --no-audit --no-fund --loglevel=error) >&2
echo "$want" >"$STAMP"
say "coding agents ready in ${SECONDS} s ($DIR/node_modules/.bin)"
