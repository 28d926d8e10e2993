"""FlashInfer's plan() and a GPU that lags the host: the hazard `flashinfer_adapter.plan` guards against.

A paged-prefill wrapper is planned for pass A and run, then planned for pass B and run, with a sleep kernel
queued first so the GPU reaches A's work only after the host planned B. plan() writes its schedule into the
wrapper's page-locked host buffer and queues the copy to the device without waiting, so unguarded, A runs on
B's schedule. `guard`: the host waits for A's copy (an event recorded after plan, as the adapter does).

    python3 scripts/gpu/plan_race_check.py              # fa2 and fa3, guarded and not: a table
    python3 scripts/gpu/plan_race_check.py fa3 none     # one case (a CUDA fault ends the process)

H200, 2026-12-02 (FlashInfer 0.6.15.post1): unguarded, fa2 gave A wrong outputs (max abs error 0.355) and
fa3 an illegal memory access; guarded, both equal the outputs planned on an idle GPU.
"""

import subprocess
import sys

import torch

H_Q, H_KV, D, P, NUM_PAGES = 14, 2, 64, 32, 4096   # Qwen2.5-Coder-0.5B's heads, page 32


def one_case(backend: str, guard: bool) -> str:
    import flashinfer
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(NUM_PAGES, H_KV, P, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(NUM_PAGES, H_KV, P, D, device=dev, dtype=torch.bfloat16, generator=g)
    pages = torch.randperm(NUM_PAGES, device=dev, generator=g).int()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend=backend)

    def plan(context: int, queries: int) -> None:
        n = -(-context // P)
        w.plan(torch.tensor([0, queries], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
               pages[:n].clone(), torch.tensor([context - (n - 1) * P], dtype=torch.int32), H_Q, H_KV, D, P,
               causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

    qa = torch.randn(1024, H_Q, D, device=dev, dtype=torch.bfloat16, generator=g)
    qb = torch.randn(1024, H_Q, D, device=dev, dtype=torch.bfloat16, generator=g)
    plan(3000, 1024)
    ref_a = w.run(qa, (k, v)).clone()
    torch.cuda.synchronize()
    errors = []
    for _ in range(3):
        torch.cuda._sleep(200_000_000)   # ~0.1 s of GPU time queued before A's plan copy
        plan(3000, 1024)
        out_a = w.run(qa, (k, v))
        copied = torch.cuda.Event()
        copied.record()
        if guard:
            copied.synchronize()
        plan(31000, 1024)
        w.run(qb, (k, v))
        torch.cuda.synchronize()
        errors.append((out_a.float() - ref_a.float()).abs().max().item())
    return f"max abs(A - A planned on an idle GPU), 3 trials: {max(errors):.4g}"


def main() -> int:
    if len(sys.argv) == 3:
        print(one_case(sys.argv[1], sys.argv[2] == "guard"))
        return 0
    print("| kernel | guarded | result |\n| --- | --- | --- |")
    for backend in ("fa2", "fa3"):
        for guard in ("none", "guard"):
            r = subprocess.run([sys.executable, __file__, backend, guard], capture_output=True, text=True)
            lines = (r.stdout + r.stderr).strip().splitlines()
            found = [x for x in lines if x.startswith("max ") or "illegal memory access" in x or "Error" in x]
            print(f"| {backend} | {guard == 'guard'} | {found[0] if found else lines[-1:]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
