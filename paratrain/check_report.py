"""`paratrain check`'s words: the report a person reads and the JSON line a program reads, from the
result paratrain/check.py builds (its criterion's figures in ``result["tolerance"]``)."""

from __future__ import annotations

import math

TOP_TENSORS = 5  # the tensors that differ most, listed


def json_safe(value: object) -> object:
    """``value`` with every non-finite float as null: strict JSON has no Infinity or NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def number(x: float | None) -> str:
    return "-" if x is None else f"{x:.6f}"


def rel(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{abs(a - b) / max(abs(b), 1e-30):.2e}"


def report(result: dict, descriptions: dict[str, str]) -> str:
    """The human-readable report: losses side by side, the tensors that differ most, the verdict."""
    tol = result["tolerance"]
    why = (result.get("reference") or {}).get("why")
    lines = [f"reference: {descriptions['reference']}" + (f" ({why})" if why else "")
             + f";  layout: {descriptions['layout']}", "",
             f"{'step':>5}  {'loss reference':>15}  {'loss layout':>15}  {'rel diff':>9}  "
             f"{'counted tokens':>14}"]
    ref, lay = result["losses"]["reference"], result["losses"]["layout"]
    for i, (a, b) in enumerate(zip(lay, ref)):
        lines.append(f"{i + 1:>5}  {number(b):>15}  {number(a):>15}  {rel(a, b):>9}  "
                     f"{result['tokens']['layout'][i]!s:>14}")
    n = len(result["max_rel_diff"])
    lines += ["", f"tensors that differ most (relative Frobenius difference, of {n}):"]
    ranked = sorted(result["max_rel_diff"].items(), key=lambda kv: -kv[1])[:TOP_TENSORS]
    lines += [f"  {d:.3e}  {name}" for name, d in ranked]
    checks = result["checks"]
    lines += ["", "checks: " + ", ".join(f"{k} {'ok' if v else 'DIFFER'}" for k, v in checks.items())]
    resume = result["resume"]
    lines.append(f"resume: the layout's checkpoint of step {resume['from_step']} resumed in the reference's "
                 "layout: "
                 + ("same as the uninterrupted reference" if resume["ok"] else
                    "DIFFERS: " + ", ".join(k for k, v in resume["checks"].items() if not v)))
    same = "equal in every run" if result["tokens"]["ok"] else "DIFFER"
    lines.append(f"counted tokens (the loss's divisor) per step: {same}")
    lines += [f"  {p}" for p in (result["problems"] + resume["problems"])[:TOP_TENSORS]]
    why = (f"fp32; losses within rtol {tol['rtol']:g} + atol {tol['atol']:g}, grad norms too at step 1 "
           f"and within rtol {tol['grad_norm_rtol_after_update']:g} once an update has run; "
           + weights_criterion(tol) + "): fp32 sums in another order differ by ~1e-6, a layout bug by ~lr "
           "on most elements")
    lines += ["", f"verdict: {result['verdict']} ({why})"]
    return "\n".join(lines + failure_lines(result))


def weights_criterion(tol: dict) -> str:
    return (f"every tensor within rtol {tol['rtol']:g} + atol {tol['atol']:g} + {tol['drift']:.3g} "
            f"({tol['drift_factor']} x lr x steps) but for at most {tol['flip_fraction']:g} of its elements, "
            f"each <= {tol['flip_bound']:.3g} ({tol['flip_factor']} x lr x steps)")


LATE_STEP = 3  # a layout's bug shows at step 1 (its gradient) or 2 (its first update)


def failure_lines(result: dict) -> list[str]:
    """Where each failing comparison first differs: its step and the tensor that differs most; and
    when the layout agreed for the first steps, that this may be chaos rather than a bug."""
    lines = []
    for what, part in (("layout", result), ("resume", result["resume"])):
        ok = part["ok"] if what == "resume" else all(part["checks"].values())
        if not ok:
            step = part.get("first_step_that_differs")
            lines.append(f"{what}: first differs at step {step if step is not None else '-'}; "
                         f"the tensor that differs most: {part['first_worst_tensor']}")
    step = result.get("first_step_that_differs")
    if step is not None and step >= LATE_STEP:
        lines.append(f"note: the layout agreed with the reference for {step - 1} steps; a layout bug shows "
                     "at step 1 or 2, while rounding differences amplified by an unstable run (a high lr, "
                     "a rising loss) grow step by step: run check again with fewer --steps or a lower --lr "
                     "to tell them apart")
    return lines
