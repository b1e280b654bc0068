"""Chapter 13: the attention benchmarks' shared report (``nanovllm.bench.report``) and the parts of
``python -m nanovllm.bench.attention`` that need no GPU: its chart, its command line and the optional
FlashAttention 4 backend. The timings themselves run on a GPU (``scripts/gpu-ci.sh kernels``)."""

from __future__ import annotations

import datetime
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from nanovllm.bench import attention, report

SVG = {"svg": "http://www.w3.org/2000/svg"}


# ---- the report --------------------------------------------------------------------------------------------
def test_write_report_round_trips_through_json_and_writes_nothing_without_a_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = {"command": "python -m nanovllm.bench.attention --quick", "copy_bytes_per_s": 3.5e12,
               "decode": [{"batch": 1, "context": 512, "ms": {"1": 0.02, "4": 0.01}, "best_splits": 4}],
               "flash_attn": False}
    out = tmp_path / "attention.json"
    report.write_report(figures, str(out))
    assert json.loads(out.read_text(encoding="utf-8")) == figures
    monkeypatch.chdir(tmp_path)
    for nowhere in (None, ""):
        report.write_report({"other": 1}, nowhere)
    assert [p.name for p in tmp_path.iterdir()] == ["attention.json"]
    assert json.loads(out.read_text(encoding="utf-8")) == figures  # left as it was


def test_report_header_names_the_command_as_typed_and_what_ran_it(monkeypatch: pytest.MonkeyPatch) -> None:
    header = report.report_header("python -m nanovllm.bench.attention", ["--out", "my results.json"], "cpu")
    assert header["command"] == "python -m nanovllm.bench.attention --out 'my results.json'"
    assert abs(datetime.date.fromisoformat(header["date"]) - datetime.date.today()) <= datetime.timedelta(days=1)
    assert (header["python"], header["torch"]) == (platform.python_version(), torch.__version__)
    assert "device" not in header  # a CPU run names no GPU
    monkeypatch.setattr(sys, "argv", ["attention.py", "--quick"])
    assert report.report_header("python -m nanovllm.bench.attention", None, "cpu")["command"] == \
        "python -m nanovllm.bench.attention --quick"  # None: this process's own arguments
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    assert report.report_header("bench", [], "cuda")["device"] == "NVIDIA H200"


# ---- the chart ---------------------------------------------------------------------------------------------
def test_line_chart_svg_places_points_on_a_log2_x_axis_and_pairs_dashed_with_solid() -> None:
    series = {"plain": [(1, 0.0), (4, 55.0)], "split": [(1, 110.0), (2, 55.0), (4, 110.0)],
              "plain, long": [(1, 11.0), (4, 33.0)]}
    svg = attention.line_chart_svg(series, "decode", "batch", "% of copy bandwidth")
    root = ET.fromstring(svg)  # well-formed, one self-contained SVG
    assert root.tag == "{http://www.w3.org/2000/svg}svg" and (root.get("width"), root.get("height")) == ("560", "300")
    lines = root.findall("svg:polyline", SVG)
    # x: 1 at the left edge (50), 4 at the right one (560 - 150), 2 halfway on a log2 axis; y: 0 at the bottom
    # (300 - 40), y_max (110) at the top (30).
    assert [line.get("points") for line in lines] == [
        "50.0,260.0 410.0,145.0", "50.0,30.0 230.0,145.0 410.0,30.0", "50.0,237.0 410.0,191.0"]
    # Series go by pairs: one color each pair, the first of a pair dashed, the second solid.
    assert [line.get("stroke-dasharray") for line in lines] == ["5,3", None, "5,3"]
    assert [line.get("stroke") for line in lines] == ["#1f77b4", "#1f77b4", "#ff7f0e"]
    texts = [text.text for text in root.findall("svg:text", SVG)]
    assert texts[0] == "decode" and {"batch", "% of copy bandwidth", *series} <= set(texts)
    # The y ticks every 20 up to y_max, then one tick per x, in order.
    assert [t for t in texts if t.isdigit()] == ["0", "20", "40", "60", "80", "100", "1", "2", "4"]


# ---- the command and the optional backend ------------------------------------------------------------------
def test_main_refuses_a_machine_without_cuda_and_writes_what_run_measured(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"bench\.attention needs a CUDA GPU"):
        attention.main([])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "run", lambda quick=False: {"quick": quick, "decode": []})
    out = tmp_path / "attention.json"
    attention.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text(encoding="utf-8")) == {"quick": True, "decode": []}
    attention.main([])  # no --out: measured, written nowhere
    assert [p.name for p in tmp_path.iterdir()] == ["attention.json"]


def test_flash_attn_backend_is_none_where_flash_attention_4_cannot_be_imported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Missing:
        def __init__(self) -> None:
            raise ImportError("No module named 'flash_attn.cute'")

    class Installed:
        pass

    monkeypatch.setattr(attention, "FlashAttnBackend", Missing)
    assert attention.flash_attn_backend() is None
    monkeypatch.setattr(attention, "FlashAttnBackend", Installed)
    assert isinstance(attention.flash_attn_backend(), Installed)
