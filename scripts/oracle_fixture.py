#!/usr/bin/env python3
"""Run a synthetic Qwen3-MoE checkpoint through Hugging Face transformers (float32) and write the
fixture that the Rust oracle test compares against (tests/fixtures/oracle_hf.json).

The model is made by nibble itself, so no weights travel:
    nibble synth --preset tiny --format safetensors --seed 0 -o /tmp/tiny-hf
    python3 scripts/oracle_fixture.py --model /tmp/tiny-hf --out tests/fixtures/oracle_hf.json

Prompts are fixed id lists (the tokenizer has its own golden test), so the fixture checks the
forward pass alone. For each prompt it records, at every prompt position, the top-10 logits, the
logits at 16 fixed probe ids and a sum/sum-of-squares checksum of the whole row; then a greedy
continuation of 40 tokens (no EOS stop) with the same summaries of every step's logits,
where step_logits[i] are the logits after feeding greedy[i].
"""
import argparse, json, platform, sys

import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPTS = [
    [9707],                                              # one token
    [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13],  # ten ordinary ids
    [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198,
     151667, 271, 151668, 271, 40, 2776, 1661, 13, 151700, 151935],  # specials and padding ids
]
PROBES = [0, 1, 13, 198, 271, 1000, 9707, 50000, 100000, 151643, 151644, 151645, 151667, 151668, 151800, 151935]


def summarise(row):
    row = row.double()
    top = torch.topk(row, 10)
    return {
        "top_ids": top.indices.tolist(),
        "top_logits": top.values.tolist(),
        "probe_logits": row[PROBES].tolist(),
        "sum": row.sum().item(),
        "sum_sq": (row * row).sum().item(),
        "max_abs": row.abs().max().item(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--synth", default="nibble synth --preset tiny --format safetensors --seed 0",
                    help="the command that made --model (recorded in the fixture)")
    a = ap.parse_args()
    torch.manual_seed(0)
    try:  # transformers >= 5 spells it `dtype`
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    model.eval()
    rotary = model.model.rotary_emb
    cases = []
    with torch.no_grad():
        for ids in PROMPTS:
            x = torch.tensor([ids])
            logits = model(x).logits[0]
            # Greedy with the KV cache, by hand: generate()'s processors (EOS masking, min length)
            # would alter the logits recorded. step_logits[i] = logits after feeding greedy[i].
            out = model(x, use_cache=True)
            past = out.past_key_values
            nxt = int(torch.argmax(out.logits[0, -1]))
            greedy, steps = [], []
            for _ in range(a.new_tokens):
                greedy.append(nxt)
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                row = out.logits[0, -1]
                steps.append(summarise(row))
                nxt = int(torch.argmax(row))
            cases.append({
                "prompt": ids,
                "prompt_logits": [summarise(logits[t]) for t in range(len(ids))],
                "greedy": greedy,
                "step_logits": steps,
            })
    fixture = {
        "command": " ".join(sys.argv),
        "model": a.synth,
        # The rotation transformers built from the config (RoPE scaling, if any, included).
        "rope_scaling": model.config.to_dict().get("rope_scaling"),
        "inv_freq": rotary.inv_freq.double().tolist(),
        "attention_scaling": float(rotary.attention_scaling),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": "float32",
        "probe_ids": PROBES,
        "cases": cases,
    }
    with open(a.out, "w") as f:
        json.dump(fixture, f)
    print(f"wrote {a.out}: {len(cases)} prompts, transformers {transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
