"""DRAM traffic of the ADA decode kernels, read with Nsight Compute (no-dense-reconstruction
check 2): dram__bytes_read.sum over the decode and merge kernels must stay within 1.1x of
(cache bytes + queries + page tables).

    PYTHONPATH=. python3 lab/ncu_bytes.py --out results.json        # runs ncu on itself
    PYTHONPATH=. python3 lab/ncu_bytes.py --child --tiers 4/4       # the profiled program
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

LIMIT = 1.1


def child(batch, context, tiers_name, codebook="lloyd-max"):
    import cupy as cp
    from cupy_kernels import ada_decode, kernel_tables
    from validation.decode_bench import D, HKV, HQ, LADDER, build_ada
    tables = kernel_tables(LADDER, D, codebook=codebook)
    state, _ = build_ada(batch, context, tiers_name, tables)
    lay = state["layout"]
    q = cp.random.standard_normal((batch, HQ, D), dtype=cp.float32)
    out = ada_decode(q, state["pages"], state["page_tier"], state["page_count"], state["indptr"],
                     state["indices"], tables, state["sigma_k"], state["sigma_v"],
                     num_kv_heads=HKV, validate=False)
    cp.cuda.Device().synchronize()
    assert bool(cp.all(cp.isfinite(out)))
    expected = dict(cache_bytes=lay.cache_bytes, page_bytes=lay.page_bytes_total,
                    q_bytes=int(q.size * 4),
                    table_bytes=int((lay.indptr.size + 3 * lay.indices.size) * 4))
    print("EXPECTED " + json.dumps(expected), flush=True)


def parent(args):
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    results = []
    for codebook, tiers_name in [(c, t) for c in args.codebooks.split(",") for t in args.tiers.split(",")]:
        # the decode kernel of the codebook's path and the merge
        cmd = [ncu, "--clock-control", "none", "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
               "--kernel-name", "regex:ada_(decode|merge)", "--csv", "--page", "raw",
               sys.executable, os.path.abspath(__file__), "--child", "--batch", str(args.batch),
               "--context", str(args.context), "--tiers", tiers_name, "--codebook", codebook]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        log = res.stdout + res.stderr
        exp = next((json.loads(l[9:]) for l in log.splitlines() if l.startswith("EXPECTED ")), None)
        lines = [l for l in res.stdout.splitlines() if l.startswith('"')]
        read = write = 0.0
        kernels = []
        if lines:
            rd = list(csv.DictReader(io.StringIO("\n".join(lines))))
            for r in rd:
                name = r.get("Kernel Name", "")
                if "ada_" not in name:
                    continue
                rb = _to_bytes(r.get("dram__bytes_read.sum", "0"), rd[0].get("dram__bytes_read.sum"))
                wb = _to_bytes(r.get("dram__bytes_write.sum", "0"), rd[0].get("dram__bytes_write.sum"))
                read += rb
                write += wb
                kernels.append(dict(kernel=name[:60], read=rb, write=wb))
        row = dict(batch=args.batch, context=args.context, tiers=tiers_name, codebook=codebook,
                   rc=res.returncode,
                   dram_read=read, dram_write=write, kernels=kernels, expected=exp)
        if exp and read > 0:
            floor = exp["cache_bytes"] + exp["q_bytes"] + exp["table_bytes"]
            row["ratio"] = read / floor
            row["pass"] = bool(read <= LIMIT * floor)
        else:
            row["pass"] = False
            row["log_tail"] = log[-3000:]
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
        if "log_tail" in row:
            print(row["log_tail"], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0 if all(r["pass"] for r in results) else 1


def _to_bytes(value, unit_row):
    """ncu --page raw prints a units row first (e.g. 'Mbyte'); values may carry commas."""
    v = float(str(value).replace(",", "") or 0)
    return v


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--tiers", default="4/4,rdr-mix")
    ap.add_argument("--codebooks", default="lloyd-max,uniform")
    ap.add_argument("--codebook", default="lloyd-max", help="(child) the pool's codebook")
    ap.add_argument("--out", default="ncu_bytes.json")
    ap.add_argument("--timeout", type=int, default=200)
    args = ap.parse_args(argv)
    if args.child:
        child(args.batch, args.context, args.tiers, args.codebook)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
