"""Search-step cost vs a plain distillation step of the parent, and architecture-selection tokens.

Prints JSON. Both steps run on the same batch, interleaved, in one process (the minimum
over repeats is reported: the machine is shared). The search step is one teacher forward
(the sorted parent, masks off), one masked student forward and a backward to the router
logits (shared weights frozen), and the router update. The distillation step is one
teacher forward and a forward + backward + AdamW update of a full copy of the parent.

Selection tokens are what each method's configuration spends choosing an architecture:
AutoCompress ``steps x batch x seq``; Minitron++ ``candidates x (retrain_steps + score_batches)
x batch x seq`` — read from the composed ``search=default`` and ``search=minitron_pp`` configs.

    python bench/bench_search.py [--model smollm2_135m|tiny_llama] [--repeats 3] [--seq 128] [--batch 2]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--target", default="cpu_chat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)

    from autocompress_nemo.config.entry import compose
    from autocompress_nemo.context import Context
    from autocompress_nemo.distill.kd import kd_loss
    from autocompress_nemo.search.router import Router
    from autocompress_nemo.search.space import build_space
    from autocompress_nemo.search.supernet import Supernet

    cfg = compose([f"model={a.model}", f"+target={a.target}"])
    ctx = Context(cfg, say=lambda s: None)
    spec, sd, _ = ctx.parent
    x = torch.randint(0, spec.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))

    # search step: the supernet shares the teacher's weights
    net = ctx.model(spec, sd)
    for p in net.parameters():
        p.requires_grad_(False)
    decisions = build_space(spec, cfg.target.engine.capabilities, int(cfg.search.ffn_options))
    sn = Supernet(net, spec, decisions)
    router = Router(decisions)
    ropt = torch.optim.Adam(router.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)

    def search_step() -> None:
        sn.enabled = False
        with torch.no_grad():
            t = ctx.forward(net, x)
        sn.enabled = True
        sn.set_choice_weights(router.sample(1.0, gen))
        loss = kd_loss(ctx.forward(net, x), t)
        ropt.zero_grad()
        loss.backward()
        ropt.step()

    # plain distillation step of the parent: a trainable copy and a frozen teacher
    teacher = net
    student = ctx.model(spec, sd)
    for p in student.parameters():
        p.requires_grad_(True)
    sopt = torch.optim.AdamW(student.parameters(), lr=1e-5)

    def distill_step() -> None:
        sn.enabled = False
        with torch.no_grad():
            t = ctx.forward(teacher, x)
        loss = kd_loss(ctx.forward(student, x), t)
        sopt.zero_grad()
        loss.backward()
        sopt.step()

    search_step(), distill_step()  # warm-up
    ts, td = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        search_step()
        ts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        distill_step()
        td.append(time.perf_counter() - t0)

    def tokens(c) -> dict:
        s = c.search
        ac = int(s.steps) * int(s.batch_size) * int(s.seq_len)
        mt = (
            int(s.minitron_candidates)
            * (int(s.minitron_retrain_steps) + int(s.minitron_score_batches))
            * int(s.batch_size)
            * int(s.seq_len)
        )
        return {"autocompress": ac, "minitron_pp": mt}

    ac_cfg = tokens(compose([f"model={a.model}", f"+target={a.target}", "search=default"]))["autocompress"]
    mt_cfg = tokens(compose([f"model={a.model}", f"+target={a.target}", "search=minitron_pp"]))["minitron_pp"]
    out = {
        "bench": "search_step_vs_distill_step",
        "model": a.model,
        "params": sum(p.numel() for p in student.parameters()),
        "batch": a.batch,
        "seq_len": a.seq,
        "threads": a.threads,
        "device": "cpu",
        "decisions": len(decisions),
        "options": sum(len(d.options) for d in decisions),
        "search_step_s_min": min(ts),
        "distill_step_s_min": min(td),
        "ratio_search_over_distill": min(ts) / min(td),
        "goal_ratio_at_most": 1.3,
        "selection_tokens": {
            "autocompress": ac_cfg,
            "minitron_pp": mt_cfg,
            "minitron_over_autocompress": mt_cfg / ac_cfg if ac_cfg else None,
            "source": "configured budgets of search=default and search=minitron_pp",
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
