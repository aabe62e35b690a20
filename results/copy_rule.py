"""
The copy task's pre-registered rules (results/preregistered.md), as code: claim 5's mechanism per window (copy_verdict,
with R' and the fixed wording beside it), the 12,000-iteration question (long_verdict), and claim 6(b)'s training-free
rule (swap_verdict). far_copy.py applies them when it writes lm1024.json; report.py and the tests apply them again to
the JSON's own rows. Nothing here trains or reads a checkpoint.
"""
import statistics


def copy_verdict(rows, seeds):
    """The pre-registered rule on the copy runs {(kind, seed): (first-half loss, second-half loss)} of one window
    (full attention's from any window): (verdict, R per seed)."""
    if any((kind, s) not in rows for kind in ("full", "swa", "sa+swa") for s in seeds):
        return "not decidable (not run)", []
    if not all(rows["full", s][1] <= 0.3 and rows["swa", s][1] >= 0.9 * rows["swa", s][0] for s in seeds):
        return "not decidable (full attention does not copy, or SWA does)", []
    R = [(rows["swa", s][1] - rows["sa+swa", s][1]) / (rows["swa", s][1] - rows["full", s][1]) for s in seeds]
    if all(r >= 0.5 for r in R) and all(abs(rows["sa+swa", s][0] - rows["swa", s][0]) <= 0.02 for s in seeds):
        return "confirms", R
    return ("refutes" if all(r <= 0.1 for r in R) else "partial"), R


def copy_r_prime(rows, seeds):
    """R' (the secondary measure, no verdict): R on D = second - first half of each run, per seed."""
    if any((kind, s) not in rows for kind in ("full", "swa", "sa+swa") for s in seeds):
        return []
    D = {run: second - first for run, (first, second) in rows.items()}
    return [(D["swa", s] - D["sa+swa", s]) / (D["swa", s] - D["full", s]) for s in seeds]


def copy_reading(verdict, R, R_prime):
    """The pre-registered wording where the rule says partial only through its L1 clause (R >= 0.5 in every seed)
    while R' >= 0.5 in every seed; else None: R' carries no verdict of its own."""
    if verdict == "partial" and min(R) >= 0.5 and min(R_prime) >= 0.5:
        return "copies, at a cost in local modelling"
    return None


def above_bound(first_gap):
    """Per seed, whether SA+SWA's first half is above SWA's by more than the rule's 0.02: who pays a cost in local
    modelling. The write-up says it beside the pre-registered wording, never inside it."""
    return [gap > 0.02 for gap in first_gap]


def window_verdicts(rows, setup):
    """The rule at each window of setup["windows"] on the 4,000-iteration copy runs (lm1024.json's rows), full
    attention's runs at setup["window"] serving every window: {window: verdict, R, R', SA+SWA's first half minus
    SWA's per seed (the rule's L1 clause), and the fixed wording where it applies}."""
    verdicts, w0 = {}, setup["window"]
    for w in setup["windows"]:
        halves = {(r["attn"], r["seed"]): (r["first"], r["second"]) for r in rows
                  if r["task"] == "copy" and r.get("sa_perm", "head") == "head"
                  and (r["window"] == w or (r["attn"], r["window"]) == ("full", w0))}
        verdict, R = copy_verdict(halves, setup["seeds"])
        verdicts[w] = dict(verdict=verdict, R=R, R_prime=copy_r_prime(halves, setup["seeds"]), first_gap=[
            halves["sa+swa", s][0] - halves["swa", s][0] for s in setup["seeds"] if ("sa+swa", s) in halves
            and ("swa", s) in halves])
        if reading := copy_reading(verdict, R, verdicts[w]["R_prime"]):
            verdicts[w]["reading"] = reading
    return verdicts


def long_answer(sa_first, sa_copied, swa_first, gain):
    """The pre-registered answer for one seed: SA+SWA's halves at 12,000, SWA's first half, and the copy
    advantage's gain over the same seed's committed 4,000-iteration runs."""
    if sa_copied <= 0.1 and abs(sa_first - swa_first) <= 0.02:
        return "closes"
    return "does not close" if gain < 0.05 or sa_copied > 0.2 else "narrows"


def long_verdict(rows, long_rows, setup):
    """From the 12,000-iteration runs (long_rows) and the committed 4,000-iteration ones (rows): the rule at 12,000
    (full attention's 4,000-iteration runs as L2(full)), the question per seed and over all, and the same quantities
    at iterations 4,000 and 8,000 of the long runs (another schedule: no verdict). A seed counts once both its arms
    reach 12,000; with some seeds missing, their numbers are reported, and neither verdict is drawn."""
    c = setup
    ends = {(r["attn"], r["seed"]): r["curve"][-1][0] for r in long_rows}
    seeds_ = [s for s in c["seeds"] if all(ends.get((k, s)) == c["long_iters"] for k in ("sa+swa", "swa"))]
    if not seeds_:
        return dict(verdict="not decidable (not run)" if not ends else f"not decidable (runs end at iterations "
                    f"{sorted(set(ends.values()))}, not {c['long_iters']:,})")
    missing = "" if seeds_ == c["seeds"] else f"not decidable (seed {', '.join(map(str, seeds_))} of " \
        f"{', '.join(map(str, c['seeds']))} finished)"
    w = long_rows[0]["window"]
    full = {s: next(r for r in rows if (r["task"], r["attn"], r["seed"], r["window"]) == ("copy", "full", s,
                                                                                         c["window"])) for s in seeds_}
    short = {(k, s): next(r for r in rows if (r["task"], r["attn"], r["seed"], r["window"], r.get("sa_perm", "head"))
                          == ("copy", k, s, w, "head")) for k in ("sa+swa", "swa") for s in seeds_}
    at = {}
    for it in sorted({4000, 8000, c["long_iters"]} & {p[0] for p in long_rows[0]["curve"]}):
        halves = {("full", s): (full[s]["first"], full[s]["second"]) for s in seeds_}
        for r in long_rows:
            point = next((p for p in r["curve"] if p[0] == it), None)
            if point and r["seed"] in seeds_:
                halves[r["attn"], r["seed"]] = tuple(point[1:])
        verdict, R = copy_verdict(halves, seeds_)
        adv = [halves["swa", s][1] - halves["sa+swa", s][1] for s in seeds_]
        at[it] = dict(verdict=missing or verdict, R=R, R_prime=copy_r_prime(halves, seeds_), advantage=adv,
                      copied=[halves["sa+swa", s][1] for s in seeds_], first=[halves["sa+swa", s][0] for s in seeds_],
                      swa_first=[halves["swa", s][0] for s in seeds_],
                      first_gap=[halves["sa+swa", s][0] - halves["swa", s][0] for s in seeds_])
        if not missing and (reading := copy_reading(verdict, R, at[it]["R_prime"])):
            at[it]["reading"] = reading
    end = at[c["long_iters"]]
    adv4k = [short["swa", s]["second"] - short["sa+swa", s]["second"] for s in seeds_]
    answers = [long_answer(f, cp, sf, a - a4) for f, cp, sf, a, a4 in zip(end["first"], end["copied"], end["swa_first"],
                                                                           end["advantage"], adv4k)]
    overall = missing or (answers[0] if len(set(answers)) == 1 and answers[0] != "narrows" else "narrows")
    return dict(window=w, iters=c["long_iters"], seeds=seeds_, advantage_4k_committed=adv4k, answers=answers,
                answer=overall, at=at, **{k: end[k] for k in ("verdict", "R", "R_prime", "first_gap")},
                reading=end.get("reading"))


def swap_verdict(sa, swa, T):
    """Claim 6(b)'s pre-registered rule on the second-half losses {window: loss} of SA and SWA at context T."""
    below = [sa[w] < swa[w] for w in swa]
    if all(b for w, b in zip(swa, below) if w < T // 2):
        return "confirms"
    return "refutes" if not any(below) else "partial"


def swap_verdict_of(swaps, T):
    """swap_verdict on lm1024.json's swap rows (per window, the mean over SA's draws)."""
    mean = lambda kind: {r["window"]: statistics.mean(r["second"]) for r in swaps if r["attn"] == kind}  # noqa: E731
    return swap_verdict(mean("sa"), mean("swa"), T)
