"""bench/rank_scheduler.py runs at a small size and its store rows do what their names say
(no timing is checked)."""
from __future__ import annotations

import json

import numpy as np
import rank_scheduler


def test_quick_run_reports_every_row(tmp_path, capsys):
    out = tmp_path / "rank.json"
    assert rank_scheduler.main(["--quick", "--no-twin", "--sizes", "200", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["native 200"]) == {"full re-rank (first plan after W submits)", "submit one",
                                      "plan after one arrival"}
    rows = doc["store 200"]
    assert len(rows) == 6 and rows["no store (plan after one arrival)"]["ratio"] == 1.0
    assert all(r["plan_us"] > 0 for r in rows.values())
    for label, r in rows.items():
        changes = "insert" in label or "W/2" in label
        # one insert and one eviction per plan move the prompts under two shared prefixes
        assert (r["stale_per_plan"] > 0) == changes, label
    assert "store, one insert + one eviction" in capsys.readouterr().out


def test_churn_cycles_one_insert_and_one_eviction():
    heads, _ = rank_scheduler.workload(8)
    churn = rank_scheduler.Churn(heads)
    assert churn.store.entries == rank_scheduler.GROUPS - 1
    for _ in range(rank_scheduler.GROUPS + 2):
        missing = churn.missing
        inserts, evictions = churn.store.inserts, churn.store.evictions
        churn.change()
        assert (churn.store.inserts - inserts, churn.store.evictions - evictions) == (1, 1)
        assert churn.store.find(churn.heads[missing]) is not None
        assert churn.store.find(churn.heads[churn.missing]) is None and churn.missing != missing


def test_common_first_token_workload_shares_it_across_the_shared_half():
    heads, prompts = rank_scheduler.workload(64, common_first=True)
    assert len({h[0] for h in heads}) == 1
    shared = np.asarray(prompts[0::2])
    assert (shared[:, 0] == heads[0][0]).all()
    assert {tuple(p[:rank_scheduler.SHARED]) for p in shared.tolist()} <= {tuple(h) for h in heads}
    plain_heads, plain = rank_scheduler.workload(64)
    assert np.array_equal(np.asarray(plain)[1::2], np.asarray(prompts)[1::2])
    assert [h[1:] for h in plain_heads] == [h[1:] for h in heads]
