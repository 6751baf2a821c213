"""``python -m headroom estimate|plan --model config.json ...``: the command line's estimate and plan
for any transformers config. The families headroom implements itself (gpt2, llama, mistral, qwen2,
gpt_neox, qwen3, qwen3_moe, mixtral, gemma3/gemma3_text, phi3, olmo2) go through the C++ core, as ``headroom estimate`` gives them; every other model_type is
built as transformers' own model on the meta device (fp32 weights, as the native families train)
and its training step traced (``headroom.estimate(model, inputs)``). The JSON is the same object.

Exit status: 0 done (for ``estimate --memory-budget``: it fits), 1 it does not fit / nothing fits,
2 bad input, 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, Dict, List, Tuple

NATIVE = ("gpt2", "llama", "mistral", "qwen2", "gpt_neox", "qwen3", "qwen3_moe", "mixtral", "gemma3", "gemma3_text",
          "phi3", "olmo2")


class BadInput(Exception):
    """A one-line message for the user; exit status 2."""


def _value(text: str) -> Any:
    """A --set value as JSON where it parses (numbers, true/false, null, lists), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _config(path: str, overrides: List[str]) -> Dict[str, Any]:
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(cfg_path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise BadInput(f"--model '{cfg_path}': cannot read it ({e.strerror}); accepted: a config.json or a "
                       "directory holding one")
    except json.JSONDecodeError as e:
        raise BadInput(f"--model '{cfg_path}': not JSON ({e.msg} at line {e.lineno})")
    if not isinstance(data, dict) or "model_type" not in data:
        raise BadInput(f"--model '{cfg_path}': no model_type; accepted: a transformers config.json")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--set '{item}': accepted: key=value, e.g. --set num_hidden_layers=2")
        data[key] = _value(value)
    data["_origin"] = cfg_path
    return data


def _model(data: Dict[str, Any], precision: str):
    """transformers' model of the config on the meta device: the class its ``architectures`` name,
    else a seq2seq LM (encoder-decoders), a masked LM (encoders), a causal LM."""
    import torch
    import transformers

    origin = data.pop("_origin")
    kind = data["model_type"]
    try:
        config = transformers.AutoConfig.for_model(**data)
    except ValueError as e:
        if "Unrecognized model identifier" in str(e):
            raise BadInput(f"--model '{origin}': transformers {transformers.__version__} does not know model_type "
                           f"'{kind}'; accepted: a model_type of its models")
        raise BadInput(f"--model '{origin}': transformers refuses the config ({str(e).splitlines()[0]})")
    except (KeyError, TypeError) as e:
        raise BadInput(f"--model '{origin}': transformers refuses the config ({e})")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    named = [getattr(transformers, a, None) for a in data.get("architectures") or []]
    autos = [transformers.AutoModelForSeq2SeqLM, transformers.AutoModelForMaskedLM, transformers.AutoModelForCausalLM]
    if not getattr(config, "is_encoder_decoder", False):
        autos = autos[1:] if not getattr(config, "is_decoder", False) else autos[2:]
    for make in [n._from_config for n in named if n is not None] + [a.from_config for a in autos]:
        try:
            with torch.device("meta"):
                return make(config, dtype=dtype)
        except ValueError:
            continue
    raise BadInput(f"--model '{origin}': model_type '{kind}' has no seq2seq, masked or causal language-model head in "
                   "transformers; use headroom.estimate(model, inputs) from Python")


def _inputs(batch: int, seq: int) -> Dict[str, Any]:
    import torch

    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m headroom", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("estimate", "plan"):
        s = sub.add_parser(name, help=f"headroom {name} for any transformers config.json")
        s.add_argument("--model", required=True, help="a config.json, or a directory holding one")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field (repeatable), e.g. --set num_hidden_layers=2")
        s.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
        s.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, momentum, adagrad, adafactor (default adamw)")
        s.add_argument("--device", default="cpu", help="cpu, or cuda: a card's caching allocator (default cpu)")
        s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        if name == "estimate":
            s.add_argument("--batch", type=int, default=8, help="sequences per micro-batch (default 8)")
            s.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
            s.add_argument("--precision", default="fp32", help="fp32, bf16-mixed, fp16-mixed, bf16 (default fp32)")
            s.add_argument("--checkpointing", default="none", help="none or full (default none)")
            s.add_argument("--memory-budget", help="bytes per device, e.g. 24GiB: exit 1 when the peak exceeds it")
        else:
            s.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
            s.add_argument("--memory-budget", required=True, help="bytes per device, e.g. 80GiB")
            s.add_argument("--precision", default="fp32",
                           help="native families: the precision to start from; other models: every one of fp32 "
                                "and bf16-mixed is searched")
    return p


def _estimate(a, data, headroom) -> Tuple[dict, int]:
    if data["model_type"] in NATIVE:
        data.pop("_origin")
        out = headroom.estimate(data, batch=a.batch, seq=a.seq, accum=a.accum, precision=a.precision,
                                optimizer=a.optimizer, checkpointing=a.checkpointing, device=a.device)
        out.setdefault("reserved_bytes", out.get("peak_reserved_bytes", 0))
        out["traced"] = {"note": "headroom's own implementation of the family"}
    else:
        out = headroom.estimate(_model(data, a.precision), _inputs(a.batch, a.seq), precision=a.precision,
                                optimizer=a.optimizer, checkpointing=a.checkpointing, device=a.device, accum=a.accum)
    status = 0
    if a.memory_budget:
        budget = headroom.parse_size(a.memory_budget)
        out["budget_bytes"] = budget
        out["fits"] = out["peak_bytes"] <= budget
        status = 0 if out["fits"] else 1
    return out, status


def _print_estimate(out: dict, headroom) -> None:
    f = headroom.format_bytes
    print(f"{out['model']['name']} ({out['model']['params']:,} parameters): peak {f(out['peak_bytes'])} in "
          f"{out['peak_phase']}; a card's caching allocator would reserve {f(out['reserved_bytes'])}")
    for k, v in sorted(out["breakdown"].items(), key=lambda kv: -kv[1]):
        if v:
            print(f"  {k:<18} {f(v)}")
    print(f"  ({out['traced']['note']})")
    if "fits" in out:
        print(f"{'fits' if out['fits'] else 'does NOT fit'} the budget of {f(out['budget_bytes'])}")


def _plan(a, data, headroom) -> Tuple[dict, int]:
    if data["model_type"] in NATIVE:
        data.pop("_origin")
        out = headroom.plan(data, global_batch=a.global_batch, budget=a.memory_budget, seq=a.seq,
                            precision=a.precision, optimizer=a.optimizer, device=a.device)
    else:
        out = headroom.plan(_model(data, "fp32"), _inputs(1, a.seq), global_batch=a.global_batch,
                            budget=a.memory_budget, optimizer=a.optimizer, device=a.device)
    return out, 0 if out.plans else 1


def _print_plan(out, a, headroom) -> None:
    f = headroom.format_bytes
    if not out.plans:
        print(f"nothing fits in {a.memory_budget}; the smallest peak considered: {out.get('smallest_peak')}")
        return
    for p_ in out.plans:
        print(f"micro-batch {p_['batch']} x {p_['accum']}, {p_['precision']}, checkpointing {p_['checkpointing']}, "
              f"{p_['optimizer']}: peak {f(p_['predicted_peak_bytes'])}, step time x{p_['predicted_step_time_ratio']}")


def main(argv=None) -> int:
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output quietly
    a = _parser().parse_args(argv)
    try:
        for flag in ("seq", "batch", "accum", "global_batch"):
            value = getattr(a, flag, 1)
            if value < 1:
                raise BadInput(f"--{flag.replace('_', '-')} {value}: accepted: a positive whole number")
        import headroom

        data = _config(a.model, a.set)
        out, status = (_estimate if a.command == "estimate" else _plan)(a, data, headroom)
    except BadInput as e:
        print(f"headroom: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("headroom: interrupted", file=sys.stderr)
        return 130
    except ValueError as e:  # headroom's own checks of the settings, one line each
        print(f"headroom: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(out, indent=2))
    elif a.command == "estimate":
        _print_estimate(out, headroom)
    else:
        _print_plan(out, a, headroom)
    return status


if __name__ == "__main__":
    sys.exit(main())
