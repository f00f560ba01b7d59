"""bench.current: recorded runs become the current tables at the top of BENCHMARKS.md."""

from __future__ import annotations

import json

import pytest

from bench import current


def rows(decode: float) -> list[dict]:
    return [
        {
            "label": "decode",
            "ours": decode,
            "peer": 10.0,
            "ratio": decode / 10,
            "target": ">= 1.3x",
            "met": decode / 10 >= 1.3,
        },
        {"label": "idle CPU", "ours": 1.0, "peer": 1.0, "ratio": 1.0, "target": "", "met": None},
    ]


RUN = {
    "date": "2026-11-25T17:50:00+00:00",
    "ratios": {
        "1 rank": {"mlx_lm.server": rows(20.0), "mlx_lm.server (our few-row sgemm)": rows(12.0)},
        "2 ranks, even-head variant": {"mlx_lm.server (quiet launcher)": rows(14.0)},
        "2 ranks": {"mlx_lm.server": []},  # the peer cannot split the model's heads
    },
}


def test_records_render_one_table_per_setup_with_verdicts(tmp_path, monkeypatch):
    monkeypatch.setattr(current, "backend", lambda: "cpu")
    written = current.record(RUN, "python -m bench.compare --record", "Xeon, 2 cores", tmp_path)
    assert [p.name for p in written] == [  # none for the setup no peer measured
        "compare-cpu-1-rank.json",
        "compare-cpu-2-ranks-even-head-variant.json",
    ]
    assert json.loads(written[0].read_text())["command"] == "python -m bench.compare --record"
    text = current.render(tmp_path)
    assert "### CPU backend, 1 rank" in text and "### CPU backend, 2 ranks" in text
    assert (
        "| decode, >= 1.3x | 2.00x (20.00 / 10.00): met | 1.20x (12.00 / 10.00): **missed** |"
        in text
    )
    assert "idle CPU" not in text  # informational rows stay in the run's own report


def test_update_rewrites_only_between_the_markers(tmp_path, monkeypatch):
    monkeypatch.setattr(current, "backend", lambda: "cpu")
    current.record(RUN, "cmd", "Xeon", tmp_path)
    doc = tmp_path / "B.md"
    doc.write_text(f"# Top\n{current.BEGIN}\nold\n{current.END}\n## History\nkept\n")
    current.update(doc, tmp_path)
    text = doc.read_text()
    assert text.startswith("# Top\n") and text.endswith("## History\nkept\n")
    assert "old" not in text and "2.00x" in text
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        current.update(doc, tmp_path)
