"""Beam search and ``return_dict_in_generate`` through the pipeline equal transformers, at world sizes 1, 2, 3.

For decoder-only models (LLaMA, GPT-2; Qwen2 at world 1) with left-padded prompts and for T5, with
2 microbatches of 2 prompts each (each microbatch holds whole beam groups) and with the default
microbatching:
  * beam search's sequences equal transformers' ``generate(num_beams=...)`` token for token, with
    ``num_return_sequences``, ``length_penalty`` and ``early_stopping`` True / False / "never", and an
    EOS id picked from a reference run so that beams finish at different steps; decoder-only models
    also with ``prefill_chunk_size`` and ``no_repeat_ngram_size`` (a processor reading each beam's past);
  * with ``return_dict_in_generate=True`` the output is transformers' class, and its
    ``sequences_scores``, per-step ``scores`` and ``logits`` (beam and greedy: rows that finished
    early included) match to 1e-3 relative (fp32, see TOL), ``beam_indices`` exactly;
  * seeded sampling's dict equals the one-process pipelined run (the per-row stream is not transformers');
  * two data-parallel replicas (world 2, one stage each) give the same beams;
  * refused beam arguments (num_return_sequences > num_beams, num_beams=2.5, beam sampling,
    output_hidden_states) raise the same error on every rank, and the model generates afterwards.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed

NEW = 6  # new tokens per request
# fp32 scores and logits, relative to 1 + |value|. The pipeline runs transformers' own modules on each
# microbatch, and is bitwise equal to transformers run on those same rows; but transformers itself gives a
# batch of 4 and two batches of 2 different roundings where the GEMM blocking depends on the row count
# (T5 here, logits up to ~30: up to 3.6e-5 relative, measured on an AVX-512 AMD EPYC). What this must catch (a
# wrong cache, mask, position bias or processor) moves scores by 1e-1 or more, so 1e-3 sits between.
TOL = 1e-3
ARCHS = ("llama", "gpt2", "t5")
SAMPLE = dict(do_sample=True, temperature=0.9, top_k=20, seed=5)
REFUSED = (  # (kwargs, error class, start of its message)
    (dict(num_beams=2, num_return_sequences=3), "InputError", "`num_return_sequences` (3) has to be smaller"),
    (dict(num_beams=2.5), "InputTypeError", "num_beams must be an int >= 1, got 2.5"),
    (dict(num_beams=2, do_sample=True), "InputError", "generation mode 'beam_sample' is not supported"),
    (dict(num_beams=2, return_dict_in_generate=True, output_hidden_states=True), "InputError",
     "output_attentions / output_hidden_states are not supported"),
)


def _cases(eos: int, encoder_decoder: bool) -> dict[str, dict]:
    """Label -> generate kwargs; the same for the reference and the pipeline."""
    base = dict(max_new_tokens=NEW, pad_token_id=0, eos_token_id=eos)
    scored = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    cases = {
        "beam": dict(base, num_beams=3, num_return_sequences=2, length_penalty=0.7, early_stopping=True),
        "never": dict(base, num_beams=2, early_stopping="never", length_penalty=1.5),
        "beam_dict": dict(base, num_beams=3, num_return_sequences=3, early_stopping=False, **scored),
        "greedy_dict": dict(base, do_sample=False, **scored),
    }
    if not encoder_decoder:  # chunked prefill (refused for T5) and a processor that reads each beam's history
        cases["beam_chunked"] = dict(base, num_beams=2, prefill_chunk_size=3, no_repeat_ngram_size=2)
    return cases


# --------------------------------------------------------------------------- run on every rank
def _run(case):
    import hf_pipeline

    model = getattr(hf_pipeline, case["auto"]).from_pretrained(
        case["path"], pipeline=True, device="cpu", progress=False, **case["load"]
    )
    inputs, out = case["inputs"], {}
    for label, kwargs in case["cases"].items():
        if case["replicas"] and kwargs.get("return_dict_in_generate"):
            continue  # refused with data-parallel replicas
        out[label] = model.generate(**inputs, **kwargs, n_microbatches=2)
    out["beam_default_mb"] = model.generate(**inputs, **case["cases"]["beam"])
    if not case["replicas"]:
        out["sample_dict"] = model.generate(**inputs, **case["sample"])
    if case["refusals"]:
        errors = []
        for kwargs, _, _ in REFUSED:
            try:
                model.generate(**inputs, max_new_tokens=NEW, **kwargs)
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - the class and message are what is compared
                errors.append((type(e).__name__, str(e)))
        out["errors"] = errors
        out["after"] = model.generate(**inputs, **case["cases"]["beam"], n_microbatches=2)
    return out


def _job(cases):
    return [_run(c) for c in cases]


# --------------------------------------------------------------------------- references (parent process)
def _pick_eos(ref, inputs, start: int) -> int:
    """A token id that ends some beams of the beam search and some greedy rows early, not all at once."""
    free = ref.generate(**inputs, max_new_tokens=NEW, num_beams=3, pad_token_id=0, eos_token_id=tiny.VOCAB + 5)
    for eos in free[:, start + 1: start + NEW - 1].flatten().tolist():
        if eos in (0, 1):
            continue
        beams = ref.generate(**inputs, max_new_tokens=NEW, num_beams=3, pad_token_id=0, eos_token_id=eos)
        greedy = ref.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos)
        ended = (greedy[:, start:] == eos).any(dim=1)
        if (beams[:, start:-1] == eos).any() and ended.any() and not ended.all():
            return eos
    raise AssertionError("no token ends some beams and rows early; change the tiny model seed")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import hf_pipeline

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("beam")
    out = {}
    for arch in (*ARCHS, "qwen2"):
        extra = {"t5": {"initializer_factor": 3.0}}.get(arch, {})
        path = tiny.make_checkpoint(root / arch, arch, **extra)
        auto = tiny.AUTO.get(arch, "AutoModelForCausalLM")
        ref = tiny.reference(path, auto)
        inputs = tiny.sample_inputs("llama", batch=4, seq=7, pad_left=arch != "t5")
        start = 1 if arch == "t5" else inputs["input_ids"].shape[1]
        with torch.no_grad():
            eos = _pick_eos(ref, inputs, start)
            cases = _cases(eos, encoder_decoder=arch == "t5")
            want = {label: ref.generate(**inputs, **kwargs) for label, kwargs in cases.items()}
        sample = dict(SAMPLE, max_new_tokens=NEW, pad_token_id=0, eos_token_id=eos, return_dict_in_generate=True,
                      output_scores=True)
        # The sampling reference is the pipelined model on one process with one stage.
        one = getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", progress=False)
        want["sample_dict"] = one.generate(**inputs, **sample)
        want["beam_default_mb"] = want["beam"]
        out[arch] = dict(path=str(path), auto=auto, inputs=inputs, cases=cases, sample=sample, want=want)
    return out


def _case(assets, arch: str, load: dict, refusals: bool = False, replicas: bool = False) -> dict:
    a = assets[arch]
    return dict(path=a["path"], auto=a["auto"], inputs=a["inputs"], cases=a["cases"], sample=a["sample"],
                load=load, refusals=refusals, replicas=replicas)


def _same(got, want, where: str) -> None:
    """``got`` equals transformers' ``want``: ids exactly, scores to TOL, of the same output class."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), f"{where}: ids differ\n{got}\n{want}"
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__} is not transformers' {type(want).__name__}"
    for name in ("sequences", "beam_indices"):
        if getattr(want, name, None) is not None:
            g, w = getattr(got, name), getattr(want, name)
            assert g.dtype == w.dtype and torch.equal(g, w), f"{where}: {name} differ\n{g}\n{w}"
    if getattr(want, "sequences_scores", None) is not None:
        diff = (got.sequences_scores - want.sequences_scores).abs().max().item()
        assert diff <= TOL, f"{where}: sequences_scores differ by {diff}"
    for name in ("scores", "logits"):
        w, g = getattr(want, name), getattr(got, name)
        if w is None:
            assert g is None, f"{where}: {name} not asked for but returned"
            continue
        assert g is not None and len(g) == len(w), f"{where}: {name} has {g and len(g)} steps, not {len(w)}"
        for step, (gs, ws) in enumerate(zip(g, w)):
            assert gs.shape == ws.shape, f"{where}: {name}[{step}] shape {tuple(gs.shape)} != {tuple(ws.shape)}"
            finite = torch.isfinite(ws)
            assert torch.equal(finite, torch.isfinite(gs)), f"{where}: {name}[{step}] -inf positions differ"
            # Relative to the value: T5's logits here reach the hundreds (fp32 rounding grows with them).
            diff = ((gs[finite] - ws[finite]).abs() / (1 + ws[finite].abs())).max().item()
            assert diff <= TOL, f"{where}: {name}[{step}] differs by {diff} (relative)"


def _check(assets, cases, per_rank, world: int) -> None:
    for c, case in enumerate(cases):
        arch = next(a for a in assets if assets[a]["path"] == case["path"])
        want = assets[arch]["want"]
        for rank, results in enumerate(per_rank):
            res = results[c]
            where = f"{arch} world={world} load={case['load']} rank {rank}"
            for label, w in want.items():
                if label in res or not case["replicas"]:
                    _same(res[label], w, f"{where} {label}")
            if case["refusals"]:
                for (kwargs, cls, start), got in zip(REFUSED, res["errors"]):
                    assert got is not None and got[0] == cls and got[1].startswith(start), (
                        f"{where} {kwargs}: {got} is not {cls}: {start}..."
                    )
                _same(res["after"], want["beam"], f"{where} after the refusals")


@pytest.mark.equiv  # every beam request on 3 architectures: about 4 s on 2 shared cores
def test_beam_and_output_dicts_world_1(assets):
    # One process, three stages (virtual): the same ring with local hand-offs; Qwen2 only here.
    cases = [_case(assets, arch, {"virtual_stages": 3}) for arch in (*ARCHS, "qwen2")]
    cases[0]["refusals"] = True
    _check(assets, cases, [_job(cases)], 1)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_beam_and_output_dicts_across_ranks(assets, world):
    cases = [_case(assets, arch, {}, refusals=arch == "llama") for arch in ARCHS]
    if world == 2:  # two data-parallel replicas of a one-stage pipeline: each takes whole beam groups
        cases.append(_case(assets, "llama", {"num_stages": 1}, replicas=True))
    per_rank = run_distributed(_job, world, cases, timeout=300)
    _check(assets, cases, per_rank, world)
