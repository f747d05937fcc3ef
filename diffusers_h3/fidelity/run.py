# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""A fidelity run: every case generates the same prompts with the same seeds, each clip is compared with the
reference case's, and the distances, the speed and the gates go to a JSON report and an HTML page.

Layout of the output folder::

    run.json                  the generation settings (a folder holding other settings is refused)
    clips/<case>/p<i>_s<seed>.mp4 (+ .json: seconds, what was applied)   reused when present (resumable)
    fidelity.json             the report (schema below, docs/fidelity.md)
    index.html, images/*.png  the page

A case that fails (loading, a request, an out-of-memory) is recorded with its error and the run goes on.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .cases import FIDELITY_CASES, FidelityCase, apply_case, apply_text_encoder_case, get_case
from .compare import compare_clips, json_ready


SCHEMA = "diffusers-h3-fidelity/1"
# The summary value each gate reads (the worst clip of a case): video gates use the YUV 4:2:0 metrics (SGLang's).
GATE_METRICS = {
    "min_ssim": ("ssim_yuv420", "the lowest mean SSIM (YUV 4:2:0) of a clip"),
    "min_psnr": ("psnr_yuv420", "the lowest mean PSNR (YUV 4:2:0, dB) of a clip"),
    "min_audio_cosine": ("audio_cosine", "the lowest log-mel spectral cosine of a clip"),
    "min_audio_si_sdr": ("audio_si_sdr_db", "the lowest SI-SDR (dB) of a clip's channels"),
    "min_audio_correlation": ("audio_correlation", "the lowest waveform correlation of a clip's channels"),
    "max_lpips": ("lpips", "the highest mean LPIPS of a clip"),
    "rms_ratio_range": ("rms_ratio", "the RMS ratio of every clip"),
}


class FidelityRunError(ValueError):
    """The run cannot start (its output folder holds a run with other settings, an unknown case)."""


@dataclass
class FidelitySettings:
    """What every case generates. ``steps``: sigma points (``None``: the pipeline's default); ``compile``: the
    presets' regional torch.compile on CUDA; ``model``: what was loaded (recorded, and part of what a resumed run must
    match); ``crf``: libx264's for the clips, 0 (lossless YUV 4:2:0, the default) so that the distances are the
    path's, not the encoder's (players without H.264's lossless profile cannot show such files: the page does not
    need them)."""

    prompts: List[str]
    seeds: List[int]
    cases: List[str]
    against: str = "exact"
    height: Optional[int] = None
    width: Optional[int] = None
    num_frames: Optional[int] = None
    steps: Optional[int] = None
    compile: bool = True
    model: str = ""
    crf: int = 0

    def __post_init__(self):
        for name in [self.against, *self.cases]:
            get_case(name)
        if not self.prompts or any(not p.strip() for p in self.prompts):
            raise FidelityRunError("give at least one prompt, none empty")
        if not self.seeds:
            raise FidelityRunError("give at least one seed")

    @property
    def run_cases(self) -> List[str]:
        """The reference first, then the other cases in the order given (the reference once)."""
        return [self.against] + [c for c in dict.fromkeys(self.cases) if c != self.against]

    def clips(self) -> List[Tuple[int, int]]:
        return [(i, seed) for i in range(len(self.prompts)) for seed in self.seeds]


# The audio gates on by default: they separate a faster path from a different clip. SI-SDR 20 dB leaves 1 % of the
# waveform's energy as residual, and a correlation of 0.995 is the same 20 dB. Another seed moves the waveform beyond
# that while its log-mel spectral cosine stays near 1 (on the demo checkpoint: 18 dB / 0.992 against 23-24 dB /
# 0.998 for the `fast` and `fastest` presets); serving engines report 30 dB / 0.9997 for cached profiles of H3.
DEFAULT_MIN_AUDIO_SI_SDR = 20.0
DEFAULT_MIN_AUDIO_CORRELATION = 0.995
AUDIO_GATES = ("min_audio_cosine", "min_audio_si_sdr", "min_audio_correlation", "rms_ratio_range")


@dataclass
class Gates:
    """Thresholds a case must meet (``None``: not checked). ``rms_ratio_range``: ``(low, high)``. The SI-SDR and
    waveform-correlation gates are on by default (``Gates.none()``: no gate at all)."""

    min_ssim: Optional[float] = None
    min_psnr: Optional[float] = None
    min_audio_cosine: Optional[float] = None
    max_lpips: Optional[float] = None
    rms_ratio_range: Optional[Tuple[float, float]] = None
    min_audio_si_sdr: Optional[float] = DEFAULT_MIN_AUDIO_SI_SDR
    min_audio_correlation: Optional[float] = DEFAULT_MIN_AUDIO_CORRELATION

    @classmethod
    def none(cls) -> "Gates":
        """No gate, the default audio gates included."""
        return cls(min_audio_si_sdr=None, min_audio_correlation=None)

    def active(self) -> Dict[str, Any]:
        return {name: value for name, value in asdict(self).items() if value is not None}


def clip_stem(prompt_index: int, seed: int) -> str:
    return f"p{prompt_index}_s{seed}"


def _check_folder(out_dir: Path, settings: FidelitySettings) -> None:
    """Write ``run.json``, or refuse a folder whose clips were generated with other settings."""
    manifest = out_dir / "run.json"
    wanted = {k: v for k, v in asdict(settings).items() if k not in ("cases", "against")}
    if manifest.is_file():
        stored = json.loads(manifest.read_text())
        differing = sorted(k for k in wanted if stored.get(k) != wanted[k])
        if differing:
            raise FidelityRunError(f"{out_dir} holds a fidelity run with other settings ({', '.join(differing)} "
                                   "differ); its clips cannot be reused: pick another output folder or delete it")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(wanted, indent=2) + "\n")


def _release_device_memory() -> None:
    """Free what the pipeline just dropped, so that the next one loads into it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _encode_prompts(case: FidelityCase, load_text_encoder: Callable[[FidelityCase], Any], settings: FidelitySettings,
                    indices: List[int]) -> Tuple[Dict[int, Tuple[torch.Tensor, torch.Tensor]], str]:  # fmt: skip
    """The case's prompt embeddings (on the CPU) from a pipeline that holds only the text encoder, freed before the
    DiT loads; returns them by prompt index, with what was applied to the text encoder."""
    pipe = None
    try:
        pipe = load_text_encoder(case)
        if getattr(pipe, "text_encoder", None) is None:
            raise FidelityRunError("load_text_encoder returned a pipeline without a text encoder")
        applied = apply_text_encoder_case(pipe, case)
        canvas = {k: v for k, v in (("height", settings.height), ("width", settings.width),
                                    ("num_frames", settings.num_frames)) if v is not None}  # fmt: skip
        embeds = {}
        for index in sorted(set(indices)):
            prompt_embeds, tags = pipe.encode_prompt(settings.prompts[index], **canvas)
            embeds[index] = (prompt_embeds.cpu(), tags.cpu())
        return embeds, applied
    finally:  # the DiT loads into the memory the text encoder frees
        pipe = None
        _release_device_memory()


def generate_case(case: FidelityCase, load_pipeline: Callable[[FidelityCase], Any], settings: FidelitySettings,
                  out_dir: Path, progress=None,
                  load_text_encoder: Optional[Callable[[FidelityCase], Any]] = None) -> Optional[str]:  # fmt: skip
    """Write the case's missing clips (a clip whose MP4 and record exist is reused); returns the error of a failed
    case (``None`` when it ran). With ``load_text_encoder`` the prompts are encoded first and ``load_pipeline`` must
    return a pipeline without text encoder (see :func:`run_fidelity`)."""
    folder = out_dir / "clips" / case.name
    missing = [(i, s) for i, s in settings.clips()
               if not ((folder / f"{clip_stem(i, s)}.mp4").is_file() and (folder / f"{clip_stem(i, s)}.json").is_file())]  # fmt: skip
    if progress is not None:
        progress.update(len(settings.clips()) - len(missing))
    if not missing:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    pipe = output = embeds = None
    try:
        if load_text_encoder is not None:
            embeds, encoder_applied = _encode_prompts(case, load_text_encoder, settings, [i for i, _ in missing])
        pipe = load_pipeline(case)
        if embeds is not None and getattr(pipe, "text_encoder", None) is not None:
            raise FidelityRunError("with load_text_encoder, load_pipeline must return a pipeline without text encoder "
                                   "(text_encoder=None, tokenizer=None, processor=None)")  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        applied = apply_case(pipe, case, compile=settings.compile)
        if embeds is not None:
            applied.append(encoder_applied)
        for index, seed in missing:
            if progress is not None:
                progress.set_postfix_str(f"{case.name} {clip_stem(index, seed)}")
            path = folder / f"{clip_stem(index, seed)}.mp4"
            prompt = {"prompt": settings.prompts[index]} if embeds is None else \
                {"prompt_embeds": embeds[index][0], "text_token_tags": embeds[index][1]}
            start = time.perf_counter()
            output = pipe(**prompt, num_frames=settings.num_frames, height=settings.height,
                          width=settings.width, num_inference_steps=settings.steps, output_type="latent",
                          generator=torch.Generator(device="cpu").manual_seed(seed))  # fmt: skip
            pipe.decode_to_video(output.frames, output.audio, path, crf=settings.crf)
            seconds = time.perf_counter() - start
            record = {"case": case.name, "prompt_index": index, "seed": seed, "seconds": round(seconds, 3),
                      "applied": applied, "export": dict(getattr(pipe, "_h3_last_export", None) or {}),
                      "cache": _cache_skips(pipe),
                      # `seconds` then leaves out the text encoder, which ran before the DiT was loaded.
                      "prompt_encoded_before": embeds is not None}  # fmt: skip
            (folder / f"{clip_stem(index, seed)}.json").write_text(json.dumps(json_ready(record), indent=2, default=str))
            if progress is not None:
                progress.update(1)
    except Exception as error:  # noqa: BLE001 - one failing case is recorded, the others still run
        lines = traceback.format_exception_only(type(error), error)
        return (lines[-1].strip() if lines else type(error).__name__)[:2000]
    finally:  # the next case loads into the memory this one frees
        pipe = output = embeds = None
        _release_device_memory()
    return None


def _cache_skips(pipe) -> Optional[Dict[str, str]]:
    """What a step cache skipped in the last request, per transformer partition (``None`` without a cache)."""
    from ..hooks.cache import describe_cache

    skips = {name: describe_cache(model) for name, model in pipe._partitions()}
    skips = {name: report["last_request"] for name, report in skips.items() if report is not None}
    return skips or None


def _generation(out_dir: Path, case: str, stem: str) -> Optional[Dict[str, Any]]:
    record = out_dir / "clips" / case / f"{stem}.json"
    return json.loads(record.read_text()) if record.is_file() else None


def _clip_summary(record: Dict[str, Any]) -> Dict[str, Any]:
    audio = record["audio"] or {}
    return {
        "psnr_y": record["psnr_y"]["mean"],
        "ssim_y": record["ssim_y"]["mean"],
        "psnr_yuv420": record["psnr_yuv420"]["mean"],
        "ssim_yuv420": record["ssim_yuv420"]["mean"],
        "worst_frame_ssim_yuv420": record["ssim_yuv420"]["worst"],
        "ssim_yuv420_drift_per_s": record["ssim_yuv420"]["drift_per_s"],
        "lpips": record["lpips"]["value"],
        "audio_cosine": audio.get("spectral_cosine"),
        "audio_si_sdr_db": audio.get("si_sdr_db"),
        "audio_correlation": audio.get("correlation"),
        "rms_ratio": audio.get("rms_ratio"),
        "no_audio": record["audio"] is None and "audio_missing" not in record,
    }


def _case_summary(clips: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The worst clip of the case for each metric (the gates read these)."""
    values = [c["summary"] for c in clips]
    if not values:
        return {}

    def worst(key, lowest=True):
        present = [v[key] for v in values if v[key] is not None]
        return (min(present) if lowest else max(present)) if present else None

    ratios = [v["rms_ratio"] for v in values if v["rms_ratio"] is not None]
    return {
        "psnr_y": worst("psnr_y"), "ssim_y": worst("ssim_y"), "psnr_yuv420": worst("psnr_yuv420"),
        "ssim_yuv420": worst("ssim_yuv420"), "worst_frame_ssim_yuv420": worst("worst_frame_ssim_yuv420"),
        "lpips": worst("lpips", lowest=False), "audio_cosine": worst("audio_cosine"),
        "audio_si_sdr_db": worst("audio_si_sdr_db"), "audio_correlation": worst("audio_correlation"),
        "no_audio": all(v.get("no_audio", False) for v in values),
        "rms_ratio": max(ratios, key=lambda r: abs(r - 1.0)) if ratios else None,
        "rms_ratio_range": [min(ratios), max(ratios)] if ratios else None,
    }  # fmt: skip


def evaluate_gates(summary: Dict[str, Any], gates: Gates) -> Dict[str, Dict[str, Any]]:
    """Each active gate against a case's summary: ``{"threshold", "value", "passed"}``; a metric that was not
    computed (LPIPS without its weights, a clip whose audio track is missing on one side) fails its gate, with the
    reason; audio gates do not apply when neither clip has an audio track (``summary["no_audio"]``)."""
    results = {}
    for name, threshold in gates.active().items():
        metric, _ = GATE_METRICS[name]
        if name in AUDIO_GATES and summary.get("no_audio"):
            results[name] = {"metric": metric, "threshold": list(threshold) if isinstance(threshold, tuple) else
                             threshold, "value": None, "passed": True,
                             "reason": "not applicable: neither clip has an audio track"}  # fmt: skip
            continue
        if name == "rms_ratio_range":
            value = summary.get("rms_ratio_range")
            passed = value is not None and threshold[0] <= value[0] and value[1] <= threshold[1]
            threshold = list(threshold)
        else:
            value = summary.get(metric)
            passed = value is not None and (value <= threshold if name.startswith("max_") else value >= threshold)
        results[name] = {"metric": metric, "threshold": threshold, "value": value, "passed": bool(passed)}
        if value is None:
            results[name]["reason"] = f"{metric} was not computed for this case"
    return results


def _speed(out_dir: Path, case: str, clips: List[Tuple[int, int]]) -> Dict[str, Any]:
    seconds = []
    for index, seed in clips:
        record = out_dir / "clips" / case / f"{clip_stem(index, seed)}.json"
        if record.is_file():
            seconds.append(json.loads(record.read_text())["seconds"])
    if not seconds:
        return {"seconds": None, "per_clip_s": []}
    # The first clip of a case pays compilation and autotuning: the median of the others when there are others.
    steady = seconds[1:] if len(seconds) > 1 else seconds
    return {"seconds": round(statistics.median(steady), 3), "per_clip_s": seconds,
            "includes_warmup": len(seconds) == 1}  # fmt: skip


def run_fidelity(
    load_pipeline: Callable[[FidelityCase], Any],
    settings: FidelitySettings,
    out_dir,
    gates: Optional[Gates] = None,
    progress: bool = True,
    note: Optional[str] = None,
    html: bool = True,
    thumbnail_width: int = 160,
    extra: Optional[Dict[str, Any]] = None,
    load_text_encoder: Optional[Callable[[FidelityCase], Any]] = None,
) -> Dict[str, Any]:
    """Generate every case's clips (missing ones only), compare each with the reference case's, write
    ``fidelity.json`` and, with ``html``, ``index.html`` + ``images/`` into ``out_dir``; returns the report.

    ``load_pipeline(case)`` returns a freshly loaded pipeline with the case's weight formats (or dense weights, which
    :func:`apply_case` then quantizes in place); it is called once per case with clips to generate. ``note``: a line
    the page and the report show at the top (e.g. that the weights are random). ``extra``: more settings to record.

    ``load_text_encoder(case)``, for a card that cannot hold the reference's text encoder and DiT together (the
    bf16 `exact` case of the released model needs about 119 GiB): it returns a pipeline loaded without the DiT
    (``transformer=None``); each case's prompts are encoded with it first, in the text-encoder weights the case runs
    (:func:`apply_text_encoder_case`), it is freed, and ``load_pipeline(case)`` then returns a pipeline loaded
    without the text encoder (``text_encoder=None, tokenizer=None, processor=None``) that generates from those
    embeddings. The clips are the ones the whole pipeline generates: the same operations in another order.
    """
    from tqdm.auto import tqdm

    gates = gates or Gates()
    out_dir = Path(out_dir)
    _check_folder(out_dir, settings)
    clips = settings.clips()
    cases = settings.run_cases
    errors: Dict[str, Optional[str]] = {}
    bar = tqdm(total=len(cases) * len(clips), desc="generate", unit="clip", disable=not progress)
    with bar:
        for name in cases:
            start = time.perf_counter()
            errors[name] = generate_case(FIDELITY_CASES[name], load_pipeline, settings, out_dir, progress=bar,
                                         load_text_encoder=load_text_encoder)  # fmt: skip
            outcome = f"failed: {errors[name]}" if errors[name] is not None else "clips written"
            bar.write(f"{name}: {outcome} ({time.perf_counter() - start:.1f} s)")

    from .html import clip_images, write_page

    reference = settings.against
    records: Dict[str, List[Dict[str, Any]]] = {name: [] for name in cases if name != reference}
    compare_bar = tqdm(total=len(clips) * len(records), desc="compare", unit="clip", disable=not progress)
    with compare_bar:
        for index, seed in clips:
            stem = clip_stem(index, seed)
            ref_path = out_dir / "clips" / reference / f"{stem}.mp4"
            if not ref_path.is_file():
                compare_bar.update(len(records))
                continue
            from .clips import read_clip

            ref_clip = read_clip(ref_path)
            for name in records:
                path = out_dir / "clips" / name / f"{stem}.mp4"
                if errors[name] is not None or not path.is_file():
                    compare_bar.update(1)
                    continue
                clip = read_clip(path)
                record = compare_clips(ref_clip, clip)
                record["reference"], record["candidate"] = (str(p.relative_to(out_dir)) for p in (ref_path, path))
                entry = {"prompt_index": index, "seed": seed, "file": record["candidate"],
                         "summary": _clip_summary(record), "generation": _generation(out_dir, name, stem),
                         "metrics": record}  # fmt: skip
                if html:
                    entry["images"] = clip_images(ref_clip, clip, record, out_dir / "images", f"{name}_{stem}",
                                                  thumbnail_width=thumbnail_width)  # fmt: skip
                records[name].append(entry)
                compare_bar.update(1)

    report_cases: Dict[str, Any] = {}
    reference_speed = _speed(out_dir, reference, clips)
    all_passed = errors[reference] is None
    for name in cases:
        case = FIDELITY_CASES[name]
        speed = _speed(out_dir, name, clips)
        generated = [_generation(out_dir, name, clip_stem(i, s)) for i, s in clips]
        applied = next((g["applied"] for g in generated if g is not None), None)
        entry: Dict[str, Any] = {"description": case.description, "status": "failed" if errors[name] else "ok",
                                 "error": errors[name], "applied": applied, "speed": speed}  # fmt: skip
        if speed["seconds"] and reference_speed["seconds"]:
            speed["speedup_vs_reference"] = round(reference_speed["seconds"] / speed["seconds"], 3)
        if name == reference:
            entry["status"] = "reference" if errors[name] is None else "failed"
        else:
            summary = _case_summary(records[name])
            entry["summary"] = summary
            entry["clips"] = records[name]
            entry["gates"] = evaluate_gates(summary, gates) if errors[name] is None and summary else {}
            complete = errors[name] is None and len(records[name]) == len(clips)
            entry["passed"] = complete and all(g["passed"] for g in entry["gates"].values())
            all_passed = all_passed and entry["passed"]
        report_cases[name] = entry

    from .._version import __version__

    report = {
        "schema": SCHEMA,
        "note": note,
        "settings": {**asdict(settings), "text_encoder_first": load_text_encoder is not None, **(extra or {})},
        "gates": {name: (list(v) if isinstance(v, tuple) else v) for name, v in gates.active().items()},
        "environment": {"diffusers_h3": __version__, "torch": torch.__version__,
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"},  # fmt: skip
        "cases": report_cases,
        "passed": bool(all_passed),
        "html": "index.html" if html else None,
    }
    report = json_ready(report)
    (out_dir / "fidelity.json").write_text(json.dumps(report, indent=2) + "\n")
    if html:
        write_page(report, out_dir)
    return report
