"""`./launch.sh plan`'s lines on the model transfer (remote mode): per worker, the bytes it
will receive from this host (its share, or the whole model with MODEL_TRANSFER=full), what
it already holds of them, and its disk, asked of the worker's receiver over SSH without
changing anything there (acquisition/receive.py `inventory`). A worker whose code was not
synced yet (no start so far) is shown with what it would receive alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from acquisition.identity import ModelIdentity, identify
from config.settings import Settings
from distributed.plan import Plan
from launcher.hostfile import worker_destinations
from launcher.model_sender import ask_inventory
from launcher.share_source import Offer, full_offer, share_offer


def _size(count: int) -> str:
    if count >= 1 << 30:
        return f"{count / 2**30:.2f} GiB"
    return f"{count / 2**20:.1f} MiB"


def _line(rank: int, dest: str, offer: Offer, found: dict[str, Any] | str) -> tuple[str, bool]:
    """One worker's line, and whether it is short of disk."""
    head = f"  rank {rank} on {dest}"
    whole = f"{_size(offer.total_bytes)} ({offer.description})"
    if isinstance(found, str):
        return f"{head}: receives {whole}; what it holds and its disk: unknown ({found})", False
    if found["have"] == "full":
        return f"{head}: holds a full copy ({found['directory']}): receives nothing", False
    if found.get("refused"):
        return f"{head}: receives {whole}: SHORT of disk: {found['refused']}", True
    held = f"; holds {_size(found['have_bytes'])} of it already" if found["have_bytes"] else ""
    return (
        f"{head}: receives {_size(found['need_bytes'])} of {whole}{held}; disk: "
        f"{_size(found['free_bytes'])} free in {Path(found['directory']).parent.parent}",
        False,
    )


def transfer_lines(settings: Settings, model_dir: Path, plan: Plan) -> tuple[list[str], bool]:
    """The lines (none in local mode), and whether a worker is short of disk."""
    workers = worker_destinations(settings)
    if not workers:
        return [], False
    identity: ModelIdentity = identify(model_dir, settings.model_cache_dir)
    full = settings.model_transfer == "full"
    offers = [
        full_offer(model_dir, identity) if full else share_offer(model_dir, plan, rank, identity)
        for rank in range(1, len(workers) + 1)
    ]
    model_bytes = sum(w.size for w in identity.weights)
    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        found = list(
            pool.map(
                lambda each: ask_inventory(each[0][1], each[1], each[2], identity),
                zip(workers, settings.remote_dirs, offers, strict=True),
            )
        )
    lines = [
        f"model transfer (MODEL_TRANSFER={settings.model_transfer}): this host sends each "
        f"worker its part of the model ({_size(model_bytes)} of weights here)"
    ]
    short = False
    for rank, ((_, dest), offer, answer) in enumerate(zip(workers, offers, found, strict=True), 1):
        line, lacking = _line(rank, dest, offer, answer)
        lines.append(line)
        short = short or lacking
    return lines, short
