"""Markdown rendering of `bench.table2`'s JSON (the bench writes the JSON; this only formats it)."""

from __future__ import annotations

NAMES = {"fixed": "GRPO", "pos": "Ada-pos", "balance": "Ada-balance"}


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{x:+.0%}"


def _opt(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def reference_section(d: dict) -> str:
    ref, paper, ratios = d["reference"], d["paper_seconds"], d["ratios"]
    rows = []
    for rule, name in NAMES.items():
        r = ref[rule]
        ratio = 1.0 if rule == "fixed" else ratios[rule]
        paper_ratio = 1.0 if rule == "fixed" else d["paper_ratios"][rule]
        rows.append((name, f"{r['time_per_step']:.1f}", f"{paper[rule]:.0f}", f"{ratio:.2f}", f"{paper_ratio:.2f}",
                     _pct(ratio / paper_ratio - 1), f"{r['samples_per_step']:.0f}", f"{r['round_s_per_step']:.1f}",
                     f"{r['overhead_s_per_step']:.1f}", f"{r['learner_s_per_step']:.1f}",
                     f"{r['useful_per_step']:.0f}", f"{r['zero_adv_share']:.0%}", f"{r['mean_len']:.0f}",
                     f"{r['kept_mean_len']:.0f}"))
    head = ("strategy", "model s/step", "paper s/step", "model x GRPO", "paper x GRPO", "ratio vs paper",
            "samples/step", "generation s", "rounds' overhead + scoring s", "learner s", "useful groups/step",
            "zero-adv groups", "mean length", "kept mean length")
    phases = []
    for i, ph in enumerate(ref["fixed"]["phases"]):
        cells = [str(ph["step"])]
        for rule in NAMES:
            p = ref[rule]["phases"][i]
            cells += [f"{p['time_per_step']:.0f}", f"{p['samples_per_step']:.0f}"]
        phases.append(tuple(cells))
    phase_head = ("step",) + tuple(f"{NAMES[r]} {k}" for r in NAMES for k in ("s/step", "samples"))
    return (f"## Table 2, reproduced (round-synchronous, colocated, 8 GPUs)\n\n{_table(head, rows)}\n\n"
            f"Per phase of the 600-step run (each row: the population at that step):\n\n"
            f"{_table(phase_head, phases)}\n")


def fig5_section(d: dict) -> str:
    rows = [(r["step"], f"{r['pos_extra']:.0f}", _opt(r["pos_extra_paper"]), f"{r['balance_extra']:.0f}",
             _opt(r["balance_extra_paper"]), f"{r['unresolved_no_pos']:.0f}", _opt(r["unresolved_no_pos_paper"]),
             f"{r['unresolved_no_neg']:.0f}", _opt(r["unresolved_no_neg_paper"])) for r in d["fig5"]]
    head = ("step", "pos: samples in rounds 2-4", "paper", "balance: samples in rounds 2-4", "paper",
            "balance unresolved, < 2 positives", "paper", "balance unresolved, < 2 negatives", "paper")
    return ("## The population against the paper's Fig. 5\n\nPer 512 prompts. The spread of the population was "
            "fitted to the Ada-pos column only; the others are predictions.\n\n" + _table(head, rows) + "\n")


def sensitivity_section(d: dict) -> str:
    base = d["ratios"]
    rows = []
    for r in d["sensitivity"]:
        swing = max(abs(r[k][rule] / base[rule] - 1) for k in ("low", "high") for rule in base)
        rows.append((swing, (r["constant"], f"{r['value']:.4g}", f"{r['low']['pos']:.2f}", f"{r['high']['pos']:.2f}",
                             f"{r['low']['balance']:.2f}", f"{r['high']['balance']:.2f}", f"{swing:.0%}")))
    rows.sort(key=lambda x: -x[0])
    head = ("constant", "value", "pos at 0.5x", "pos at 1.5x", "balance at 0.5x", "balance at 1.5x", "largest change")
    return (f"## Sensitivity of the ratios (each constant at 0.5x and 1.5x, the others fixed)\n\nBase: Ada-pos "
            f"{base['pos']:.2f}x, Ada-balance {base['balance']:.2f}x.\n\n{_table(head, [r for _, r in rows])}\n")


def band_section(d: dict) -> str:
    """The joint band of plausible constants, and the out-of-sample check (absent from older JSON)."""
    if "joint_band" not in d:
        return ""
    b = d["joint_band"]
    rows = [(NAMES[rule], f"{b[rule]['p5']:.2f}-{b[rule]['p95']:.2f}", f"{b[rule]['p50']:.2f}",
             f"{b[rule]['paper']:.2f}", "yes" if b[rule]["paper_inside"] else "no",
             f"{b[rule]['within_20pct_share']:.0%}") for rule in ("pos", "balance")]
    head = ("ratio", "5-95% band", "median", "paper", "paper inside", "draws within +-20% of the paper")
    text = (f"## Every constant varied at once: the band plausible constants give\n\nEach of the "
            f"{len(d['sensitivity'])} constants above drawn log-uniformly within 1/{b['spread']:g}x.."
            f"{b['spread']:g}x of its value, all at once, {b['draws']} draws (replaying the reference runs). The band "
            "is what the model predicts when its constants are only known to that precision; the last column is how "
            f"often the +-20% check would pass anyway.\n\n{_table(head, rows)}\n")
    oos = [r for r in d.get("out_of_sample", []) if r.get("scale") is not None]
    if oos:
        rows = [(f"{NAMES[r['fit']]} (set to the paper's {d['paper_ratios'][r['fit']]:.2f}x)", f"{r['scale']:.2f}x",
                 NAMES[r["predict"]], f"{r['predicted']:.2f}", f"{r['paper']:.2f}", _pct(r["error"]))
                for r in oos]
        head = ("calibrated on", f"{', '.join(oos[0]['knob'])} scale", "predicted", "model", "paper", "error")
        text += ("\nOut of sample: one ratio calibrated to the paper's by the constant the ratios move most with, the "
                 f"other predicted.\n\n{_table(head, rows)}\n")
    return text


def absolute_section(d: dict) -> str:
    rows = [(r["where"], f"{r['scale']:.2f}x", f"{r['seconds']['fixed']:.0f}", f"{r['seconds']['pos']:.0f}",
             f"{r['seconds']['balance']:.0f}", f"{r['ratios']['pos']:.2f}", f"{r['ratios']['balance']:.2f}")
            for r in d["absolute_fits"]]
    head = ("missing seconds put into", "scale needed", "GRPO s", "Ada-pos s", "Ada-balance s", "pos x GRPO",
            "balance x GRPO")
    g = d["reference"]["fixed"]["time_per_step"]
    return (f"## The paper's absolute seconds\n\nThe model's GRPO step takes {g:.0f} s, the paper's 102 s. Each row "
            f"scales one part of the model until GRPO takes 102 s and shows the ratios that follow (paper: 2.24x, "
            f"2.84x).\n\n{_table(head, rows)}\n")


def ablation_section(d: dict) -> str:
    rows = [(r["variant"], f"{r['seconds']['fixed']:.0f}", f"{r['ratios']['pos']:.2f}",
             f"{r['ratios']['balance']:.2f}", f"{r['ratios']['balance'] / r['ratios']['pos']:.3f}")
            for r in d["ablations"]]
    head = ("variant", "GRPO s", "pos x GRPO", "balance x GRPO", "balance / pos")
    p = d["paper_ratios"]
    return (f"## Which parts of the model make the ratios\n\nThe same reference runs replayed with parts switched "
            f"off. Paper: balance / pos = {p['balance'] / p['pos']:.3f}.\n\n" + _table(head, rows) + "\n")


def streaming_section(d: dict) -> str:
    rows = [(r["split"], NAMES[r["rule"]], r["unresolved"], f"{r['time_per_step']:.1f}",
             f"{r['samples_per_step']:.0f}", f"{r['useful_per_step']:.0f}", f"{r['s_per_useful']:.3f}",
             f"{r['vs_reference_grpo']:.2f}", f"{r['vs_streaming_grpo']:.2f}", f"{r['utilisation']:.0%}",
             f"{r['learner_busy']:.0%}", f"{r['evicted_per_step']:.0f}", f"{r['aborted_per_step']:.0f}")
            for r in d["streaming"]]
    head = ("split", "strategy", "unresolved", "s/step", "samples/step", "useful groups/step", "s/useful group",
            "x round-sync GRPO", "x streaming GRPO", "engine slots busy", "learner busy", "evicted/step",
            "aborted/step")
    return ("## This project's setups (streaming, generation and training on separate GPUs)\n\nSteady state, "
            "averaged over the same phases. `x round-sync GRPO` divides seconds per useful group by the reference "
            "GRPO's above; `x streaming GRPO` by streaming GRPO (fixed + keep) on the same split. max_staleness 1, "
            "downsample freshest, weight sync after every step (publish, then every engine pauses to load and "
            "re-prefills its running sequences).\n\n" + _table(head, rows) + "\n")


def constants_section(d: dict) -> str:
    rows = [(k, f"{v:.4g}", d["sources"].get(k, "")) for k, v in d["constants"].items()]
    derived = [(k, f"{v:,.1f}") for k, v in d["derived"].items()]
    return (f"## Constants\n\n{_table(('constant', 'value', 'source or derivation'), rows)}\n\nWhat they imply:\n\n"
            f"{_table(('figure', 'value'), derived)}\n")


def misfit_section(d: dict) -> str:
    """What the model does not reproduce, in numbers (and directions) taken from `d`."""
    r, p = d["ratios"], d["paper_ratios"]
    g = d["reference"]["fixed"]["time_per_step"]
    fits = {x["where"]: x for x in d["absolute_fits"]}
    alike = fits.pop("every time constant alike")
    down = [w for w, x in fits.items() if x["ratios"]["pos"] < r["pos"] and x["ratios"]["balance"] < r["balance"]]
    up = [w for w, x in fits.items() if x["ratios"]["pos"] > r["pos"] and x["ratios"]["balance"] > r["balance"]]
    gap = {x["variant"]: x["ratios"]["balance"] / x["ratios"]["pos"] for x in d["ablations"]}
    base_gap, flat_gap = gap["as derived"], gap["both (the old model's engine)"]
    indep_gap = gap["lengths independent of correctness and difficulty"]
    lengths = ("do not open it (GRPO's own samples are mostly wrong, hence long, too)"
               if indep_gap >= base_gap - 0.005 else "open it")
    squeeze = ": the barrier alone squeezes it" if flat_gap < base_gap else ""
    rows = [x for x in d["fig5"] if x["unresolved_no_pos_paper"] is not None]
    mean = {k: sum(x[k] for x in rows) / max(len(rows), 1) for k in (
        "unresolved_no_pos", "unresolved_no_pos_paper", "unresolved_no_neg", "unresolved_no_neg_paper")}
    return (
        "## What fits and what does not\n\n"
        f"- Absolute seconds: the model's GRPO step takes {g:.0f} s, the paper's 102 s. A slowdown shared by every "
        f"part ({alike['scale']:.2f}x) keeps both ratios; the missing seconds in one part alone push both ratios "
        f"down ({'; '.join(down) or 'none'}) or up ({'; '.join(up) or 'none'}).\n"
        f"- The gap between the two variants: balance / pos is {base_gap:.3f} here, {p['balance'] / p['pos']:.3f} in "
        "the paper. Without the costs paid per generated sample (verl's driver scoring each sample in turn, decode "
        f"steps that grow with the batch) it is {flat_gap:.3f}{squeeze}. Lengths that depend on correctness and "
        f"difficulty {lengths}: lengths independent of both give {indep_gap:.3f}.\n"
        f"- Fig. 5 (per 512 prompts, mean over the phases it covers): Ada-balance prompts unresolved for lack of "
        f"positives {mean['unresolved_no_pos']:.0f} here, {mean['unresolved_no_pos_paper']:.0f} in the paper; for "
        f"lack of negatives {mean['unresolved_no_neg']:.0f} here, {mean['unresolved_no_neg_paper']:.0f} in the "
        "paper: the population's hardest and easiest tails are cruder than the real one.\n"
        "- Not modelled: the reference's GRPO script also computes reference-model log-probs (use_kl_loss with "
        "coefficient 0) and uses fixed micro-batches where its Ada script uses dynamic ones; validation and "
        "checkpoints; responses growing or shrinking differently in the three runs (only the pass rate follows "
        "each run's own reward curve).\n")


def render(d: dict) -> str:
    """The whole results page for the JSON `d` written by `bench.table2`."""
    r, p = d["ratios"], d["paper_ratios"]
    ok = all(d["within_20pct"].values())
    head = (f"# Table 2 of Reinforce-Ada in a cost model, and this project's setups\n\nCommand: `{d['command']}` "
            f"({d['elapsed_s']:.0f} s)\n\nAda-pos {r['pos']:.2f}x GRPO (paper {p['pos']:.2f}x, "
            f"{_pct(r['pos'] / p['pos'] - 1)}), Ada-balance {r['balance']:.2f}x (paper {p['balance']:.2f}x, "
            f"{_pct(r['balance'] / p['balance'] - 1)}): {'both' if ok else 'NOT both'} within +-20%, "
            f"with the constants at the end of this page.\n")
    return "\n".join((head, reference_section(d), fig5_section(d), sensitivity_section(d), band_section(d),
                      ablation_section(d), absolute_section(d), misfit_section(d), streaming_section(d),
                      constants_section(d)))
