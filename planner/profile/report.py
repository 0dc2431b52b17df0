"""What `pdserve profile` prints: a few lines in plain words (what one prefill, one decode step and the KV link
take), and with --verbose the fits behind them (coefficients, R², co-run factors, each phase's seconds)."""

from __future__ import annotations

from pdserve.planner.profile.corun_fit import CoRun
from pdserve.planner.profile.fit import Profile

SUMMARY_PROMPT = 1000  # tokens of the prompt the summary's prefill time is for
SUMMARY_BATCH, SUMMARY_CONTEXT = 8, 512  # the decode step the summary names: 8 requests of 512 tokens each


def summary_lines(profile: Profile) -> list[str]:
    """Prefill of a 1,000-token prompt, a decode step at batch 8, the KV link's bandwidth: from the fits."""
    prefill = profile.prefill_fit.predict({"intercept": 1.0, "tokens": SUMMARY_PROMPT,
                                           "attention": float(SUMMARY_PROMPT * SUMMARY_PROMPT)})
    decode = profile.decode_fit.predict({"intercept": 1.0, "batch": SUMMARY_BATCH,
                                         "context": SUMMARY_BATCH * SUMMARY_CONTEXT})
    per_byte = profile.transfer_fit.coefficients.get("bytes", 0.0)
    latency = profile.transfer_fit.coefficients.get("intercept", 0.0)
    link = f"{1e-9 / per_byte:.2f} GB/s" if per_byte > 0 else "too fast to time at these sizes"
    clock = "CPU time of one core" if profile.clock == "cpu" else "wall time"
    return [f"  prefill: {prefill * 1000:,.1f} ms for a {SUMMARY_PROMPT:,}-token prompt",
            f"  decode step at batch {SUMMARY_BATCH} ({SUMMARY_CONTEXT} tokens of context each): {decode * 1000:,.1f} ms",
            f"  KV link: {link}, plus {latency * 1000:.1f} ms per request's KV",
            f"  ({clock}; the fits, R² and co-run factors are in the JSON, and printed with --verbose)"]


def compute_line(profile: Profile) -> str:
    """What the profiled engine computed on and in: 'cpu (AMD EPYC; native bf16 yes, AMX no), bfloat16'."""
    cap = profile.capability
    device = str(profile.machine.get("device", "cpu"))
    if cap is None:
        where = f"{device} ({profile.machine.get('gpu') or profile.machine.get('cpu') or 'unrecorded'})"
    elif cap.device == "cpu":
        flags = ", ".join(f"{name} {'unknown' if value is None else ('yes' if value else 'no')}"
                          for name, value in (("native bf16", cap.native_bf16), ("AMX", cap.amx)))
        where = f"cpu ({cap.name}; {flags})"
    else:
        where = f"{cap.device} ({cap.name})"
    dtype = profile.engine.dtype or "an unrecorded dtype (a profile from before pdserve recorded it)"
    return f"the profile's engine: {where}, computing in {dtype}"


def print_profile(profile: Profile, headline: str, verbose: bool = False) -> None:
    print(headline)
    print(f"  {compute_line(profile)}")
    for line in summary_lines(profile):
        print(line)
    if verbose:
        print_fits(profile)


def print_fits(profile: Profile) -> None:
    print(f"fits on the {profile.clock} clock:")
    for name in ("prefill", "decode", "transfer"):
        fit = getattr(profile, f"{name}_fit")
        terms = ", ".join(f"{k} {v:.3g}" for k, v in fit.coefficients.items())
        print(f"  {name:<8} {terms}  (R^2 {fit.r2:.3f}, mean relative error {fit.mean_relative_error:.1%}, "
              f"{fit.num_points} points)")
    reference = profile.machine.get("reference")
    if reference is not None:
        print(f"  reference: a {reference['prompt_len']}-token prompt alone through a served engine took "
              f"{reference['served_prefill_wall_s']:.3f} s ({reference['served_prefill_cpu_s']:.3f} s CPU); "
              f"the prefill fit says {reference['profile_prefill_s']:.3f} s")
    corun = profile.machine.get("decode_corun")
    if corun is not None and "skipped" not in corun:
        print_corun(corun, f"prompts on core {corun['prefill_core']}", profile.decode_corun)
        beside = corun.get("beside_decode")
        if beside is not None:
            print_corun(beside, f"decode steps on core {beside['decode_core']}", profile.decode_beside_decode)
    phases = profile.machine.get("phase_seconds")
    if phases:
        print("  time: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in phases.items()))
    print(f"  KV link CPU: sender {profile.transfer_sender_cpu_per_byte * 2**20 * 1000:.2f} ms/MiB, receiver "
          f"{profile.transfer_receiver_cpu_per_byte * 2**20 * 1000:.2f} ms/MiB" + link_thread_share(profile))


def link_thread_share(profile: Profile) -> str:
    """How much of each side's link CPU its own sending/receiving thread spent (the rest: zmq's I/O thread)."""
    points = profile.transfer_points
    if not points or any(p.sender_thread_cpu_s is None for p in points):
        return ""
    shares = [sum(getattr(p, f"{side}_thread_cpu_s") for p in points) / max(sum(getattr(p, f"{side}_cpu_s")
                                                                               for p in points), 1e-12)
              for side in ("sender", "receiver")]
    return f"; of that, the sending thread {shares[0]:.0%}, the receiving thread {shares[1]:.0%}"


def print_corun(measured: dict, beside: str, factors: CoRun) -> None:
    """One line per kind of neighbour: each shape's ratio, and the factors of the step's two parts."""
    ratios = ", ".join(f"{shape} x{row['cpu_ratio']:.2f}" for shape, row in measured["batches"].items())
    print(f"  co-run: decode steps beside {beside}: {ratios}; factors: weights x{factors.weights:.2f}, "
          f"KV reads x{factors.kv_reads:.2f}")
