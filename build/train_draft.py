"""Distils a small draft for a Llama-family target: `make draft`.

    .venv/bin/python build/train_draft.py --target models/smollm2-135m-instruct \
        --out drafts/smollm2-135m-instruct

1. Data: the target answers (greedy) varied instructions: templated tasks over topics
   (build/draft_prompts.py) and instructions the target writes itself when shown an empty
   user turn (sampled, seeded). Generation runs on this project's own batching loop.
2. Vocabulary: the draft's head scores only the `--head-size` tokens most frequent in those
   answers; every other token gets draft probability 0, which keeps sampling exact and
   makes the head, which would dominate a small model's cost, 6x cheaper.
3. Model: the target's first `--layers` decoder layers, its final norm and its embedding
   (frozen, shared), with the reduced head initialised from the matching embedding rows.
4. Training: cross-entropy against the target's greedy next token on answer positions,
   a fixed number of epochs, one seed: the same command gives the same draft.
Writes the draft's own weights (fp16, without the shared embedding) to --out;
build/prepare_models.py joins them with the target's embedding under models/.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from build.draft_prompts import (
    SELF_INSTRUCT_PREFIX,
    drop_evaluation_prompts,
    templated_prompts,
)
from specdec.engines.calls import LocalEngines
from specdec.engines.llama import HEAD_TOKEN_IDS, LlamaEngine, load_hf_checkpoint
from specdec.loop.config import SchedulerConfig
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.paths import PROJECT_ROOT
from specdec.text.request import GenerationRequest
from specdec.text.tokenizer import TextTokenizer

DRAFT_WEIGHTS = "draft.safetensors"


@dataclass
class DraftConfig:
    target: Path
    out: Path
    work_dir: Path
    layers: int = 2
    head_size: int = 16384
    teacher_top_k: int = 32  # 0: hard labels only
    num_templated: int = 600
    num_self_instruct: int = 600
    max_answer_tokens: int = 160
    epochs: int = 4
    batch_tokens: int = 4096
    learning_rate: float = 1e-3
    seed: int = 0
    eval_prompts: Path = PROJECT_ROOT / "loadtest" / "prompts.jsonl"


# -- 1. data ---------------------------------------------------------------------------------
def generate_all(target: LlamaEngine, tokenizer: TextTokenizer, requests) -> list:
    """Runs requests through the batching loop with k = 0 (the target alone)."""
    config = SchedulerConfig(
        num_slots=target.num_slots,
        max_context=target.max_length,
        max_draft_tokens=0,
        default_draft_tokens=0,
        max_queue=10**6,
    )
    scheduler = SpeculativeScheduler(LocalEngines(target, target), config, tokenizer.decode)
    sequences = [scheduler.submit(r) for r in requests]
    done, start = 0, time.time()
    while scheduler.has_work:
        finished = sum(u.finished for u in scheduler.step().updates)
        if (done + finished) // 100 > done // 100:
            print(
                f"  {done + finished}/{len(sequences)} in {time.time() - start:.0f} s", flush=True
            )
        done += finished
    return sequences


def self_instructions(target, tokenizer, count: int, seed: int) -> list[str]:
    prefix = tokenizer.encode(SELF_INSTRUCT_PREFIX)
    requests = [
        GenerationRequest(
            prompt=None,
            prompt_ids=prefix,
            max_tokens=48,
            temperature=0.8,
            top_p=0.95,
            seed=seed * 100_003 + i,
            end_id=tokenizer.eos_token_id,
        )
        for i in range(count)
    ]
    texts = [s.detokenizer.text.strip() for s in generate_all(target, tokenizer, requests)]
    return sorted({t for t in texts if 3 <= len(t.split()) <= 60})


def answer_all(target, tokenizer, prompts: list[str], max_tokens: int) -> list[dict]:
    requests = [
        GenerationRequest(
            prompt=None,
            prompt_ids=tokenizer.encode(tokenizer.apply_chat_template(p)),
            max_tokens=max_tokens,
            end_id=tokenizer.eos_token_id,
        )
        for p in prompts
    ]
    sequences = generate_all(target, tokenizer, requests)
    return [
        {
            "prompt": p,
            "prompt_ids": s.request.prompt_ids,
            "answer_ids": s.token_ids[len(s.request.prompt_ids) :]
            + ([tokenizer.eos_token_id] if s.finish_reason == "end" else []),
        }
        for p, s in zip(prompts, sequences, strict=True)
    ]


def build_data(config: DraftConfig, tokenizer: TextTokenizer) -> tuple[list, list]:
    cache = config.work_dir / "data.json"
    if cache.exists():
        data = json.loads(cache.read_text())
        return data["train"], data["eval"]
    target = LlamaEngine.from_checkpoint(config.target, num_slots=64, max_length=512)
    evaluation = [
        json.loads(line)["prompt"]
        for line in config.eval_prompts.read_text().splitlines()
        if line.strip()
    ]
    print("writing self-instructions ...", flush=True)
    prompts = self_instructions(target, tokenizer, config.num_self_instruct, config.seed)
    prompts += templated_prompts(config.num_templated, config.seed)
    prompts = drop_evaluation_prompts(sorted(set(prompts)), evaluation)
    print(
        f"answering {len(prompts)} training and {len(evaluation)} held-out prompts ...", flush=True
    )
    train = answer_all(target, tokenizer, prompts, config.max_answer_tokens)
    held_out = answer_all(target, tokenizer, evaluation, config.max_answer_tokens)
    config.work_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"train": train, "eval": held_out}))
    return train, held_out


def teacher_top_k(config: DraftConfig, data: list, k: int) -> list[dict]:
    """The target's top-k next-token log-probabilities at every answer position, once."""
    cache = config.work_dir / f"teacher_top{k}.pt"
    if cache.exists():
        return torch.load(cache)
    target = LlamaEngine.from_checkpoint(config.target, num_slots=8, max_length=512)
    out, start = [], time.time()
    for first in range(0, len(data), 8):
        group = data[first : first + 8]
        seqs = [it["prompt_ids"] + it["answer_ids"] for it in group]
        counts = [len(it["answer_ids"]) for it in group]  # positions predicting answer tokens
        # The logits of a row's last `count + 1` positions; drop the very last (no label).
        logits = target.forward(
            torch.tensor([t for s in seqs for t in s]),
            [len(s) for s in seqs],
            list(range(len(seqs))),
            [0] * len(seqs),
            [c + 1 for c in counts],
        )
        offset = 0
        for count in counts:
            rows = torch.log_softmax(logits[offset : offset + count], dim=-1)
            top = rows.topk(k, dim=-1)
            out.append({"ids": top.indices.int(), "logprobs": top.values.half()})
            offset += count + 1
        if first % 200 == 0:
            print(f"  teacher {first}/{len(data)} in {time.time() - start:.0f} s", flush=True)
    torch.save(out, cache)
    return out


# -- 2. vocabulary ---------------------------------------------------------------------------
def head_vocabulary(train: list, size: int, always: list[int]) -> torch.Tensor:
    counts = torch.zeros(200_000, dtype=torch.long)
    for item in train:
        counts.index_add_(
            0,
            torch.tensor(item["answer_ids"]),
            torch.ones(len(item["answer_ids"]), dtype=torch.long),
        )
    ranked = [t for t in counts.argsort(descending=True).tolist() if counts[t] > 0]
    # Then unseen tokens by id: a BPE vocabulary lists its earliest (most frequent) merges
    # first, so low ids are the likeliest of the rest.
    chosen = list(dict.fromkeys(always + ranked + list(range(size))))[:size]
    return torch.tensor(sorted(chosen), dtype=torch.long)


# -- 3. model --------------------------------------------------------------------------------
class DraftModel(torch.nn.Module):
    """A few Llama layers over the target's frozen embedding, with a reduced-vocab head."""

    def __init__(self, target_dir: Path, num_layers: int, head_token_ids: torch.Tensor):
        super().__init__()
        from transformers import LlamaConfig as HFConfig
        from transformers import LlamaModel

        hf = json.loads((target_dir / "config.json").read_text())
        hf.update(num_hidden_layers=num_layers, tie_word_embeddings=False)
        self.hf_config = hf
        self.model = LlamaModel(HFConfig(**{k: v for k, v in hf.items() if not k.startswith("_")}))
        _, weights = load_hf_checkpoint(target_dir)
        own = {
            k[len("model.") :]: v
            for k, v in weights.items()
            if k.startswith("model.")
            and (not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers)
        }
        self.model.load_state_dict(own, strict=True)
        self.model.embed_tokens.weight.requires_grad_(False)  # shared with the target
        self.register_buffer("head_token_ids", head_token_ids)
        embedding = weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight", embedding)
        self.head = torch.nn.Linear(head.shape[1], len(head_token_ids), bias=False)
        self.head.weight.data.copy_(head[head_token_ids])

    def forward(self, input_ids, attention_mask):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden)  # (B, T, head size)


def batches(train: list, head_lookup: torch.Tensor, batch_tokens: int, rng: random.Random):
    """Padded batches of about batch_tokens tokens: (input_ids, attention_mask, labels,
    soft_ids, soft_probs). Labels, the target's greedy next tokens as head indices, are set on
    answer positions only (-100 elsewhere and for tokens outside the head). soft_ids and
    soft_probs hold the target's top-k distribution there (renormalised over the head), or
    are None when the items carry no teacher distribution."""
    items = sorted(train, key=lambda it: len(it["prompt_ids"]) + len(it["answer_ids"]))
    groups, current = [], []
    for item in items:
        length = len(item["prompt_ids"]) + len(item["answer_ids"])
        if current and length * (len(current) + 1) > batch_tokens:
            groups.append(current)
            current = []
        current.append(item)
    groups.append(current)
    rng.shuffle(groups)
    for group in groups:
        width = max(len(it["prompt_ids"]) + len(it["answer_ids"]) for it in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        labels = torch.full((len(group), width), -100, dtype=torch.long)
        teacher = "_teacher" in group[0]
        if teacher:
            k = group[0]["_teacher"]["ids"].shape[1]
            soft_ids = torch.zeros(len(group), width, k, dtype=torch.long)
            soft_probs = torch.zeros(len(group), width, k)
        for row, it in enumerate(group):
            seq = it["prompt_ids"] + it["answer_ids"]
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            start = len(it["prompt_ids"]) - 1  # the position predicting the first answer token
            answer = torch.tensor(it["answer_ids"])
            labels[row, start : len(seq) - 1] = head_lookup[answer]
            if teacher:
                top = head_lookup[it["_teacher"]["ids"].long()]  # (A, k), -1 outside the head
                logprobs = it["_teacher"]["logprobs"].float().masked_fill(top < 0, float("-inf"))
                soft_ids[row, start : len(seq) - 1] = top.clamp(min=0)
                soft_probs[row, start : len(seq) - 1] = torch.softmax(logprobs, -1).nan_to_num(0)
        yield ids, mask, labels, (soft_ids if teacher else None), (soft_probs if teacher else None)


@torch.no_grad()
def agreement(model: DraftModel, data: list, head_lookup: torch.Tensor) -> float:
    """Share of answer tokens where the draft's argmax is the target's greedy token."""
    model.eval()
    hits = total = 0
    for ids, mask, labels, _, _ in batches(data, head_lookup, 8192, random.Random(0)):
        predicted = model(ids, mask).argmax(-1)
        scored = labels != -100  # answer tokens inside the head; the others are misses
        hits += int(((predicted == labels) & scored).sum())
        total += int(scored.sum())
    model.train()
    outside = sum(int((head_lookup[torch.tensor(it["answer_ids"])] < 0).sum()) for it in data)
    return hits / (total + outside)


def train(config: DraftConfig, model: DraftModel, data: list, held_out: list) -> dict:
    head_lookup = torch.full((model.model.config.vocab_size,), -1, dtype=torch.long)
    head_lookup[model.head_token_ids] = torch.arange(len(model.head_token_ids))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    rng = random.Random(config.seed)
    steps_per_epoch = sum(1 for _ in batches(data, head_lookup, config.batch_tokens, rng))
    total_steps = steps_per_epoch * config.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / total_steps)),
    )
    history = {"before": agreement(model, held_out, head_lookup)}
    print(f"held-out agreement before training: {history['before']:.3f}", flush=True)
    start, step = time.time(), 0
    for epoch in range(config.epochs):
        for ids, mask, labels, soft_ids, soft_probs in batches(
            data, head_lookup, config.batch_tokens, rng
        ):
            logits = model(ids, mask)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            if soft_ids is not None:  # cross-entropy against the target's top-k as well
                log_q = torch.log_softmax(logits, -1).gather(-1, soft_ids)  # (B, T, k)
                answer = soft_probs.sum(-1) > 0
                loss = loss - (soft_probs * log_q).sum(-1)[answer].mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            if step % 20 == 0:
                print(
                    f"  epoch {epoch} step {step}/{total_steps} loss {loss.item():.3f} "
                    f"({time.time() - start:.0f} s)",
                    flush=True,
                )
        history[f"epoch{epoch}"] = agreement(model, held_out, head_lookup)
        print(f"held-out agreement after epoch {epoch}: {history[f'epoch{epoch}']:.3f}", flush=True)
    history["train_seconds"] = time.time() - start
    return history


# -- 4. output -------------------------------------------------------------------------------
def save(config: DraftConfig, model: DraftModel, info: dict) -> None:
    from safetensors.torch import save_file

    config.out.mkdir(parents=True, exist_ok=True)
    weights = {
        f"model.{k}": v.detach().to(torch.float16).contiguous()
        for k, v in model.model.state_dict().items()
        if k != "embed_tokens.weight"
    }
    weights["lm_head.weight"] = model.head.weight.detach().to(torch.float16).contiguous()
    weights[HEAD_TOKEN_IDS] = model.head_token_ids.clone()
    save_file(weights, str(config.out / DRAFT_WEIGHTS), metadata={"format": "pt"})
    hf = dict(
        model.hf_config,
        draft_head_size=len(model.head_token_ids),
        draft_embedding="shared with the target: build/prepare_models.py adds it",
    )
    (config.out / "config.json").write_text(json.dumps(hf, indent=2))
    (config.out / "training.json").write_text(json.dumps(info, indent=2, default=str))


def run(config: DraftConfig) -> None:
    torch.manual_seed(config.seed)
    tokenizer = TextTokenizer(config.target)
    data, held_out = build_data(config, tokenizer)
    num_tokens = sum(len(it["answer_ids"]) for it in data)
    print(f"{len(data)} training answers, {num_tokens} tokens", flush=True)
    if config.teacher_top_k:
        for item, teacher in zip(
            data, teacher_top_k(config, data, config.teacher_top_k), strict=True
        ):
            item["_teacher"] = teacher
    specials = [tokenizer.eos_token_id]
    head_ids = head_vocabulary(data, config.head_size, specials)
    coverage = sum(
        sum(t in set(head_ids.tolist()) for t in it["answer_ids"]) for it in held_out
    ) / sum(len(it["answer_ids"]) for it in held_out)
    print(f"head of {len(head_ids)} tokens covers {coverage:.3f} of held-out answer tokens")
    model = DraftModel(config.target, config.layers, head_ids)
    history = train(config, model, data, held_out)
    info = {
        "config": asdict(config),
        "train_answers": len(data),
        "train_tokens": num_tokens,
        "held_out_head_coverage": coverage,
        "held_out_agreement": history,
    }
    save(config, model, info)
    print(f"draft written to {config.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target", type=Path, default=PROJECT_ROOT / "models" / "smollm2-135m-instruct"
    )
    parser.add_argument(
        "--out", type=Path, default=PROJECT_ROOT / "drafts" / "smollm2-135m-instruct"
    )
    parser.add_argument("--work-dir", type=Path, default=PROJECT_ROOT / ".run" / "draft-work")
    for name, value in asdict(DraftConfig(Path(), Path(), Path())).items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args()
    run(DraftConfig(**vars(args)))


if __name__ == "__main__":
    main()
