"""The benchmark report writer (benchmarks/report.py), on records of the committed results: a partial result names
the shapes its run did not reach, in the Markdown and in the JSON; a whole one names none."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
report = pytest.importorskip("report")


def _records(name):
    with open(os.path.join(ROOT, "benchmarks", "results", name)) as f:
        return json.load(f)["records"]


@pytest.mark.parametrize("kind", ["cp_attention", "ag_gemm"])
def test_partial_result_names_what_it_did_not_measure(tmp_path, kind):
    if kind == "cp_attention":
        records = _records("cp_attention-H200x4.json")[:1]
        pending = [(1, 65536, 32, 8, 128, True), (1, 32768, 32, 8, 128, True, 12)]
        write = lambda **kw: report.write_cp(records, 4, str(tmp_path), **kw)  # noqa: E731
        line = "1,65536,32,8,128,True; 1,32768,32,8,128,True,12"
    else:
        records = _records("ag_gemm-H200x4.json")[:2]
        pending = [(8192, 8192, 8192)]
        write = lambda **kw: report.write("ag_gemm", records, 4, str(tmp_path), **kw)  # noqa: E731
        line = "8192,8192,8192"
    base = os.path.join(tmp_path, f"{kind}-{records[0]['gpu']}x4")

    write(pending=pending)
    with open(base + ".md") as f:
        md = f.read()
    with open(base + ".json") as f:
        doc = json.load(f)
    assert f"Not measured in this run (it ended before them): {line}." in md, md
    assert doc["not_measured"] == [list(s) for s in pending] and len(doc["records"]) == len(records)

    write()  # the whole run: nothing pending
    with open(base + ".md") as f:
        assert "Not measured" not in f.read()
    with open(base + ".json") as f:
        assert "not_measured" not in json.load(f)


def test_turn_orders_vary_who_goes_before_whom():
    """Columns timed in turns (timing.turn_orders): every iteration a permutation, and over a whole design (n rows,
    2n for odd n) each function runs right after each other one within the iterations equally often."""
    from collections import Counter

    from triton_overlap.timing import turn_orders

    for n in range(1, 10):
        rows = 2 * n if n % 2 else n
        orders = turn_orders(n, 3 * rows + 1)
        assert all(sorted(o) == list(range(n)) for o in orders)
        assert orders[rows:2 * rows] == orders[:rows]
        after = Counter((a, b) for o in orders[:rows] for a, b in zip(o, o[1:]))
        assert set(after) == {(a, b) for a in range(n) for b in range(n) if a != b}, n
        assert len(set(after.values())) <= 1, f"n = {n}: uneven {after}"


def test_gemm_ar_row_has_every_column_old_records_included():
    """A row for each column of the header, with the paths ours and matmul + our AllReduce took; a record written
    before the fused-kernel column (the committed W = 4 result) still makes a row, n/a where it has no value."""
    header = report.GEMM_AR_HEADER.splitlines()[0]
    new = {"M": 16, "K": 8192, "N": 8192, "algorithm": "fused", "unfused_algorithm": "one_shot", "ours_us": 20.0,
           "fused_us": 20.0, "ours_unfused_us": 18.0, "nccl_us": 30.0, "gemm_us": 15.0, "ours_graph_us": 19.0,
           "fused_graph_us": 19.0, "ours_unfused_graph_us": 17.0, "nccl_graph_us": 28.5}
    row = report.gemm_ar_row(new)
    assert row.count("|") == header.count("|") == 15, row
    assert "(fused)" in row and "(one_shot)" in row and "| 1.50x |" in row and row.endswith("| 1.50x |"), row
    old = _records("gemm_ar-H200x4.json")[0]
    row = report.gemm_ar_row(old)
    assert row.count("|") == 15 and "n/a" in row, row


def test_model_train_row_has_every_column_old_records_included():
    """The model benchmark's training row: a cell for each column of the header, ours' host time and replays per
    step among them; a record written before those columns (the committed W = 2 result) still makes a row, n/a
    where it has no value."""
    model_report = pytest.importorskip("model_report")
    header = model_report.TRAIN_HEADER.splitlines()[0]
    old = _records("model-H200x2.json")[0]
    assert old["kind"] == "train" and "ours_host_us" not in old
    new = dict(old, ours_host_us=12345.0, torch_tp_host_us=4000.0,
               ours_calls_per_step={"replays": 40.0, "rebound": 38.0, "captures": 0.0})
    row = model_report.train_row(new)
    assert row.count("|") == header.count("|"), (row, header)
    assert row.endswith("| 12.35 | 4.00 | 40 (38) |"), row
    row = model_report.train_row(old)
    assert row.count("|") == header.count("|") and row.endswith("| n/a | n/a | n/a |"), row


@pytest.mark.parametrize("kind", ["ag_gemm", "cp_attention"])
def test_results_across_hosts_say_so(tmp_path, kind):
    """A run whose group spans hosts says so in its caption, and that ours did not replay there (its summary line
    too); a run on one host says neither."""
    name = f"{kind}-H200x4-2hosts"
    records = _records(name + ".json")[:2]
    write = (report.write_cp if kind == "cp_attention"
             else lambda recs, W, out: report.write("ag_gemm", recs, W, out))

    def caption(recs, base):
        write(recs, 4, str(tmp_path))
        with open(os.path.join(tmp_path, base + ".md")) as f:
            text = f.read()
        return text.split("\n\n")[1], text

    words, text = caption(records, name)
    assert "spans 2 (virtual) hosts" in words and "enqueues every eager call anew" in words, words
    assert kind == "cp_attention" or "(eager, fallback=\"auto\", no replay across hosts)" in text
    words, text = caption([dict(r, num_hosts=1) for r in records], f"{kind}-H200x4")
    assert "hosts" not in words, words
    assert kind == "cp_attention" or "(eager, fallback=\"auto\", replay on)" in text
