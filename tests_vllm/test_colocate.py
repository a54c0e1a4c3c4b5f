"""MDIGRPOTrainer with vLLM generating (TRL's colocate mode, vLLM's CPU build), against what each result must equal.

One module-scoped set of 2-step runs on the tiny Qwen2.5-VL, all with the same seed, data and reward: stock
``GRPOTrainer`` with the trainer's prompt fix (``PromptFixedGRPOTrainer``: TRL 1.16 alone samples from a corrupted
prompt, huggingface/trl#6294), ``MDIGRPOTrainer`` with attention metrics off, and with them on. Every run records, per generation
batch, the no-grad policy forwards (TRL's importance-sampling forward, and any the trainer adds) and the inputs and
weights of the first one, on which the probe rides; the metrics-on run also records what the probe measured. The
tests then compare: parameters (observing changes nothing), forward counts (metrics cost no forward), the probe's
masses against eager attention recomputed on the very sequences vLLM generated, the engine's weights against the
synced policy, and the prompt the engine ran on against the one the trainer scores. Runs of their own: a batch
mixing image sizes, a two-image row and a text-only row; Qwen2-VL; LoRA.

Shown able to fail (one-off pytest plugins, not kept): the probe placed in an extra forward fails the forward
count ([2, 2] != [1, 1]); the probe measuring one query too many fails probe-vs-eager (1.5e-2); without the CPU
harness TRL's weight sync fails; without the prompt fix (``trl_mdi.vllm_prompts``) the engine runs 3 more prompt
tokens per row than the trainer scores; without the encoder-cache reset the mixed batch's second-batch image rows
differ from the policy by up to 0.19 in log-prob.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from fixtures import vllm_cpu
from fixtures.testing import eager_group_masses, stock_grpo_values, zen_image_dataset
from fixtures.vllm_baseline import PromptFixedGRPOTrainer
from trl_mdi import trainer as trainer_module
from trl_mdi.attention import image_token_ids, probe_attention
from trl_mdi.config import MDIGRPOConfig
from trl_mdi.trainer import MDIGRPOTrainer


def spread_reward(completions, **kwargs):
    """A reward with spread inside every group, so the policy gradient is not exactly zero."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c) % 7) for c in completions]


def common_args(tmp_path) -> dict:
    """The GRPOConfig values every run shares (a stock script passes the same to ``GRPOConfig``)."""
    return dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
                per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=2,
                logging_steps=1, save_strategy="no", seed=0, learning_rate=1e-3, disable_tqdm=True,
                **vllm_cpu.VLLM_CPU_ARGS)


def mdi_args(tmp_path, **overrides) -> MDIGRPOConfig:
    """MDIGRPOConfig with stock GRPOConfig's values where their defaults differ (the runs are compared with stock's)."""
    return MDIGRPOConfig(**{**common_args(tmp_path), **stock_grpo_values(), "rollout_log_path": str(tmp_path / "logs" / "rollouts.md"),
                            "attention_diag_log_path": str(tmp_path / "logs" / "attention.md"), **overrides})


@dataclass
class Recorded:
    """What one run did, per generation batch."""

    generations: int = 0  # calls of TRL's vLLM generate
    forwards: list[int] = field(default_factory=list)  # no-grad policy forwards per generation batch
    first_forward: list[dict] = field(default_factory=list)  # inputs + weights of each batch's first such forward
    attention: list = field(default_factory=list)  # the probe's ModalityAttention per batch (metrics-on run)
    sampling_logps: list[list[list[float]]] = field(default_factory=list)  # vLLM's, per batch, row, token
    policy_logps: list[torch.Tensor] = field(default_factory=list)  # the first policy forward's, per batch
    engine_prompts: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (sent to vLLM, vLLM's prompt)
    logs: list[dict] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    engine_weights: dict[str, tuple[torch.Tensor, str]] = field(default_factory=dict)  # engine weight, policy name
    engine_unfused: dict[str, torch.Tensor] = field(default_factory=dict)  # the engine's o_proj / down_proj weights
    completion_ids: list[list[int]] = field(default_factory=list)  # every rollout vLLM sampled
    engine_generation_kwargs: dict = field(default_factory=dict)  # the engine's sampling kwargs (TRL's copy)
    user_generation_kwargs: dict | None = None  # args.generation_kwargs after the run


UNFUSED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # linear layers vLLM does not fuse (qkv, gate_up are)


def engine_weights(trainer) -> dict[str, tuple[torch.Tensor, str]]:
    """The colocated engine's unfused text-layer weights, each with the name of the policy parameter it mirrors."""
    engine = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    policy = {n.split("layers.", 1)[1]: n for n, _ in trainer.model.named_parameters()
              if "language_model" in n and "layers." in n and n.endswith(UNFUSED)}
    return {n: (p.detach().clone(), policy[n.split("layers.", 1)[1]])
            for n, p in engine.named_parameters() if "layers." in n and n.endswith(UNFUSED)
            and "visual" not in n and n.split("layers.", 1)[1] in policy}


# What TRL's log-prob forward hands the model besides ids and mask (for the families here).
MODEL_FIELDS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids", "pixel_attention_mask",
                "image_sizes")


def record_run(monkeypatch, trainer_cls, model_dir, args, dataset, peft_config=None, reward_funcs=None) -> Recorded:
    rec = Recorded()
    gen_and_score = GRPOTrainer._generate_and_score_completions
    logps = GRPOTrainer._get_per_token_logps_and_entropies
    vllm_generate = VLLMGeneration.generate

    def gen(trainer, inputs):
        rec.forwards.append(0)
        return gen_and_score(trainer, inputs)

    def fwd(trainer, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        if not torch.is_grad_enabled() and model is trainer.model and rec.forwards:
            if rec.forwards[-1] == 0:
                rec.first_forward.append({
                    "input_ids": input_ids.clone(), "attention_mask": attention_mask.clone(),
                    "logits_to_keep": logits_to_keep,
                    "multimodal": {k: v.clone() for k, v in kw.items() if k in MODEL_FIELDS and v is not None},
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()}})
            rec.forwards[-1] += 1
            out = logps(trainer, model, input_ids, attention_mask, logits_to_keep, *a, **kw)
            if rec.forwards[-1] == 1:
                rec.policy_logps.append(out[0].detach().clone())
            return out
        return logps(trainer, model, input_ids, attention_mask, logits_to_keep, *a, **kw)

    def generate(self, *a, **kw):
        rec.generations += 1
        out = vllm_generate(self, *a, **kw)
        rec.sampling_logps.append([[t[0] for t in row] for row in out[2]])  # the sampled token's log-prob
        rec.completion_ids += [list(ids) for ids in out[1]]
        return out

    @contextlib.contextmanager
    def probe(*a, **kw):  # what the trainer's probe measured, one ModalityAttention per measured forward
        with probe_attention(*a, **kw) as state:
            yield state
        rec.attention.append(state.result())

    with monkeypatch.context() as m:
        m.setattr(GRPOTrainer, "_generate_and_score_completions", gen)
        m.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", fwd)
        m.setattr(VLLMGeneration, "generate", generate)
        m.setattr(trainer_module, "probe_attention", probe)
        trainer = trainer_cls(str(model_dir), reward_funcs=reward_funcs or [spread_reward], args=args, train_dataset=dataset,
                              peft_config=peft_config)
        assert isinstance(trainer.vllm_generation, VLLMGeneration) and trainer.vllm_generation.mode == "colocate"
        llm = trainer.vllm_generation.llm
        llm_generate = llm.generate

        def engine_generate(prompts, *a, **kw):  # the prompt token ids sent, and those the engine ran on
            outputs = llm_generate(prompts, *a, **kw)
            rec.engine_prompts += [(list(p["prompt_token_ids"]), list(o.prompt_token_ids))
                                   for p, o in zip(prompts, outputs)]
            return outputs

        llm.generate = engine_generate
        trainer.train()
    rec.logs = [h for h in trainer.state.log_history if "loss" in h]
    rec.params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rec.engine_weights = engine_weights(trainer)
    rec.engine_generation_kwargs = dict(trainer.vllm_generation.generation_kwargs)
    rec.user_generation_kwargs = trainer.args.generation_kwargs
    engine = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    rec.engine_unfused = {n: p.detach().clone() for n, p in engine.named_parameters()
                          if "layers." in n and n.endswith(UNFUSED) and "visual" not in n}
    # One engine at a time: free this one before the next run builds its own.
    del trainer
    gc.collect()
    return rec


@pytest.fixture(scope="module")
def qwen25_dir(tiny_vlm_dir):
    return tiny_vlm_dir("qwen2_5_vl")


@pytest.fixture(scope="module")
def runs(qwen25_dir, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    dataset = zen_image_dataset(8)
    out = {}
    try:
        for name, cls, metrics in [("stock", PromptFixedGRPOTrainer, None), ("metrics_off", MDIGRPOTrainer, False),
                                   ("metrics_on", MDIGRPOTrainer, True)]:
            tmp = tmp_path_factory.mktemp(name)
            args = GRPOConfig(**common_args(tmp)) if metrics is None else mdi_args(
                tmp, compute_attention_metrics=metrics)
            out[name] = record_run(mp, cls, qwen25_dir, args, dataset)
    finally:
        mp.undo()
    return out


# |policy log-prob - vLLM sampling log-prob| per completion token, both in float32 (the harness builds the engine in
# float32): different kernels, same computation (seen: 5e-7 on text-only rows, 9.5e-7 on image rows once the engine
# gets one placeholder per image). In vLLM's default bfloat16 it is about 0.1. Without the prompt fix, image rows
# differed by up to 0.16 whatever the dtype: the engine ran a corrupted prompt (huggingface/trl#6294).
LOGP_TOL = 1e-4


def test_the_engine_never_samples_an_image_placeholder(runs, qwen25_dir):
    """TRL suppresses the image token under HF generate only; a sampled placeholder makes the next policy forward
    fail ("Image features and image tokens do not match"). MDIGRPOTrainer gives its engine's copy of the sampling
    kwargs a -100 logit bias on every image token of the family (the user's config untouched), and none of the
    rollouts holds one."""
    from transformers import AutoConfig

    image_token = AutoConfig.from_pretrained(qwen25_dir).image_token_id
    for name in ("metrics_off", "metrics_on"):
        rec = runs[name]
        assert rec.engine_generation_kwargs["logit_bias"][image_token] == -100.0, name
        assert rec.user_generation_kwargs is None, name  # GRPOConfig's default, not written to
        assert all(image_token not in ids for ids in rec.completion_ids), name


def test_vllm_generated_every_batch_from_the_synced_weights(runs):
    """vLLM (not HF generate) made every rollout, and the engine's weights after the run are the policy's (cast to
    the engine's dtype): TRL's weight sync reached it. Without the CPU harness the sync fails at the first step;
    with vLLM's repacked weights left in place, generation would read stale copies."""
    for name, rec in runs.items():
        assert rec.generations == 2 and len(rec.logs) == 2, name
        assert rec.engine_weights, f"{name}: no engine weight matched a policy weight"
        # The last sync ran before the second batch was generated: the engine holds the policy of that moment,
        # which is also what the second batch's first policy forward saw.
        first, synced = rec.first_forward[0]["state"], rec.first_forward[1]["state"]
        for key, (engine, policy_name) in rec.engine_weights.items():
            assert not torch.equal(synced[policy_name], first[policy_name]), f"{policy_name} did not move in step 1"
            assert torch.equal(engine, synced[policy_name].to(engine.dtype)), f"{name}: engine {key} is stale"


def test_the_engine_generates_from_the_trainers_prompt(runs, qwen25_dir):
    """Each row vLLM generated from is the prompt the trainer scores (same ids, same image tokens), and so its
    sampling log-probs equal the policy's on every completion token, image rows included (float32 engine), once
    renormalised over the tokens the engine may sample (``suppressed_offsets``).

    TRL 1.16 alone fails this (huggingface/trl#6294): it hands vLLM the processor's expanded image tokens, which
    vLLM expands again (31 prompt tokens sent, 34 run, 7 image tokens for 4; log-probs off by up to 0.16). The
    trainer hands the engine one placeholder per image (``trl_mdi.vllm_prompts``), and stock TRL with the same fix
    (the ``stock`` run) passes too."""
    for name in ("stock", "metrics_on"):
        assert_engine_ran_the_scored_prompt(runs[name], name, suppressed_offsets(runs[name], qwen25_dir))


def suppressed_offsets(rec: Recorded, model_dir) -> list[torch.Tensor]:
    """Per batch, ``-log(1 - P)`` at every completion position, P the policy's probability of the image tokens the
    engine may not sample (``suppress_image_tokens``), recomputed from the batch's first policy forward (its inputs
    and weights as recorded). vLLM returns processed log-probs, so its log-prob of a sampled token is the policy's
    renormalised over the tokens left: ``log p - log(1 - P)``. (The random tiny models put P ~ 0.002 to 0.005 there,
    a trained model next to nothing.)"""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids_suppressed = image_token_ids(model.config)
    offsets = []
    for fwd in rec.first_forward:
        model.load_state_dict(fwd["state"])
        n = fwd["logits_to_keep"]
        with torch.no_grad():
            logits = model(input_ids=fwd["input_ids"], attention_mask=fwd["attention_mask"],
                           **fwd["multimodal"]).logits[:, -n - 1:-1].double()
        mass = logits.softmax(-1)[..., ids_suppressed].sum(-1)
        offsets.append(-torch.log1p(-mass))
    return offsets


def assert_engine_ran_the_scored_prompt(rec: Recorded, name: str, offsets: list[torch.Tensor]) -> None:
    """``offsets``: :func:`suppressed_offsets` of the run (or of a run with the same rollouts and weights)."""
    assert rec.engine_prompts and all(len(sent) < len(seen) for sent, seen in rec.engine_prompts), \
        f"{name}: the engine was not handed collapsed placeholders (every row here has an image)"
    assert min(o.max().item() for o in offsets) > LOGP_TOL  # else the check below could not see the suppression
    for batch, (sampled, policy, fwd) in enumerate(zip(rec.sampling_logps, rec.policy_logps, rec.first_forward)):
        policy = policy + offsets[batch].to(policy.dtype)
        n = fwd["logits_to_keep"]
        for i, (_, seen) in enumerate(rec.engine_prompts[4 * batch: 4 * batch + 4]):
            # The prompt as the trainer scores it: TRL's forward left-pads the prompts (mask 0 there).
            scored = [t for t, m in zip(fwd["input_ids"][i, :-n].tolist(), fwd["attention_mask"][i, :-n].tolist()) if m]
            assert seen == scored, f"{name}: batch {batch} row {i}: the engine ran on {len(seen)} prompt tokens, not the " \
                                   f"{len(scored)} the trainer scores"
            diff = (torch.tensor(sampled[i]) - policy[i, :len(sampled[i])]).abs().max().item()
            assert diff < LOGP_TOL, f"{name}: batch {batch} row {i}: |vLLM - policy| log-prob = {diff:.2e}"


def test_parameters_after_two_steps_equal_stock_grpo(runs):
    """Observing changes nothing: the same parameters after 2 steps with metrics on, off, and under stock TRL with
    the same prompt fix (``PromptFixedGRPOTrainer``). Against stock TRL 1.16 as shipped they differ, as they should:
    its engine samples from a corrupted prompt (huggingface/trl#6294), ours from the one it scores."""
    stock = runs["stock"].params
    changed = [n for n, p in stock.items() if not torch.equal(p, runs["stock"].first_forward[0]["state"][n])]
    assert changed, "stock training changed no parameter: the comparison would be vacuous"
    for name in ("metrics_off", "metrics_on"):
        params = runs[name].params
        assert params.keys() == stock.keys()
        diff = max((params[n] - stock[n]).abs().max().item() for n in stock)
        assert diff == 0.0, f"{name}: parameters differ from stock GRPOTrainer's by up to {diff:.3e}"
    assert [h["loss"] for h in runs["metrics_on"].logs] == [h["loss"] for h in runs["stock"].logs]


def test_metrics_add_no_policy_forward(runs):
    """The probe rides on TRL's importance-sampling forward: stock TRL runs one no-grad policy forward per generation
    batch under vLLM, and so does the trainer, with metrics on or off."""
    assert runs["stock"].forwards == [1, 1]
    assert runs["metrics_off"].forwards == runs["stock"].forwards
    assert runs["metrics_on"].forwards == runs["stock"].forwards


def test_the_cost_at_the_limit_under_vllm(qwen25_dir, tmp_path, monkeypatch):
    """A reward that reads MDI needs the attention before the rewards: the probe still rides TRL's importance-sampling
    forward (one no-grad policy forward per batch, as stock), and the reward gets the probe's values (the logged
    attention/mdi_balance is the mean of what mdi_balance scored, 2 * balance - 1). A reward that reads a reliance
    signal adds exactly one forward: the counterfactual (the real-image log-probs come from TRL's forward)."""
    seen = []

    def recording_mdi_balance(completions, mdi_balance, **kwargs):
        seen.append(list(mdi_balance))
        return [2.0 * b - 1.0 for b in mdi_balance]

    gains = []

    def gain(completions, visual_gain, prompts, completion_ids, image, **kwargs):
        gains.append({"visual_gain": list(visual_gain), "prompts": prompts, "completion_ids": completion_ids,
                      "images": [[i] for i in image]})
        return [0.0 if g is None else g for g in visual_gain]

    rec = record_run(monkeypatch, MDIGRPOTrainer, qwen25_dir, mdi_args(tmp_path / "mdi"), zen_image_dataset(8),
                     reward_funcs=[spread_reward, recording_mdi_balance])
    assert rec.generations == 2 and rec.forwards == [1, 1]
    assert len(seen) == 2 and all(len(b) == 4 and all(0.0 <= x <= 1.0 for x in b) for b in seen)
    for step, balances in enumerate(seen):
        assert rec.logs[step]["attention/mdi_balance"] == pytest.approx(sum(balances) / 4, abs=1e-6)
    rec = record_run(monkeypatch, MDIGRPOTrainer, qwen25_dir, mdi_args(tmp_path / "gain", log_completions=True),
                     zen_image_dataset(8), reward_funcs=[spread_reward, gain])
    assert rec.generations == 2 and rec.forwards == [2, 2]  # the completions table adds no forward
    # The completions table carries the signals, row for row: what the reward got, and at step 1 (the checkpoint's
    # weights) visual_gain recomputed by plain forwards of vLLM's completions with the image and with a black one.
    import pandas as pd
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_mdi.profile.reference import reference_signals

    for step, batch in enumerate(gains, start=1):
        table = pd.read_parquet(tmp_path / "gain" / "out" / "completions" / f"completions_{step:05d}.parquet")
        assert table["visual_gain"].tolist() == pytest.approx(batch["visual_gain"], abs=0)
        assert table["mdi"].notna().all() and table["image_evidence"].notna().all()
    model = AutoModelForImageTextToText.from_pretrained(qwen25_dir).eval()
    want = reference_signals(model, AutoProcessor.from_pretrained(qwen25_dir), gains[0]["prompts"],
                             gains[0]["images"], gains[0]["completion_ids"], "black", attention=False)
    table = pd.read_parquet(tmp_path / "gain" / "out" / "completions" / "completions_00001.parquet")
    assert table["visual_gain"].tolist() == pytest.approx(want["visual_gain"].tolist(), abs=1e-5)
    assert table["visual_gain"].nunique() > 1


def test_probe_on_vllm_rollouts_equals_eager_attention(runs, qwen25_dir):
    """The masses the probe measured in the run equal eager ``output_attentions`` weights on the same sequences
    (vLLM's completions after TRL's prompts, with the images) under the same weights, within 1e-5."""
    n_image = assert_probe_equals_eager(runs["metrics_on"], qwen25_dir)
    assert all(n > 0 for batch in n_image for n in batch)


def assert_probe_equals_eager(rec: Recorded, model_dir) -> list[list[int]]:
    """Every batch's probe masses against eager attention recomputed on the batch's first policy forward (its inputs
    and weights as recorded); returns the image-key counts per batch and row."""
    from transformers import AutoModelForImageTextToText

    assert len(rec.attention) == 2 and len(rec.first_forward) == 2
    eager = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    eager.eval()
    image_ids = torch.tensor(image_token_ids(eager.config))
    counts = []
    for batch, (attention, fwd) in enumerate(zip(rec.attention, rec.first_forward)):
        eager.load_state_dict(fwd["state"])
        ids, am, n = fwd["input_ids"], fwd["attention_mask"], fwd["logits_to_keep"]
        with torch.no_grad():
            out = eager(input_ids=ids, attention_mask=am, output_attentions=True, **fwd["multimodal"])
        # Groups as the trainer lays the batch out: the last n positions are the completion (right-padded, masked).
        keys = am.bool()
        completion = torch.zeros_like(keys)
        completion[:, -n:] = True
        image = torch.isin(ids, image_ids) & keys
        groups = torch.stack([image, keys & ~completion & ~image, keys & completion & ~image,
                              torch.zeros_like(image)], dim=-1)
        queries = keys & completion
        assert queries.sum(1).min() > 0
        ref = eager_group_masses(out.attentions, groups, queries)
        got = torch.stack([attention.image, attention.prompt_text, attention.completion, attention.special], dim=-1)
        err = (got[:, attention.layers].double() - ref).abs().max().item()
        assert err < 1e-5, f"batch {batch}: max |probe - eager| = {err:.2e} (fields {sorted(fwd['multimodal'])})"
        assert attention.n_image.tolist() == image.sum(1).tolist()
        assert attention.n_queries.tolist() == queries.sum(1).tolist()
        counts.append(image.sum(1).tolist())
    return counts


# Families whose prompt the trainer hands vLLM exactly (trl_mdi.vllm_prompts, tests_vllm/test_prompt_ids.py) but whose
# checkpoints, as transformers 5.17 saves them, vLLM 0.31 cannot load: its LLaVA loaders expect the vision tower's
# weights under vision_tower.vision_model.* (the layout of the hub's llava-hf checkpoints, saved by transformers 4),
# and transformers 5 saves them under vision_tower.*.
VLLM_CANNOT_LOAD = ("llava", "llava_onevision")


@pytest.mark.parametrize("arch", ["qwen2_vl", *VLLM_CANNOT_LOAD])
def test_other_families_train_under_vllm_and_their_probe_equals_eager(arch, tiny_vlm_dir, tmp_path, monkeypatch):
    """The other Qwen family vLLM's CPU build runs: Qwen2-VL (its own vision tower and processor) generates under
    vLLM from the prompt the trainer scores, adds no policy forward, and its probe equals eager attention on vLLM's
    rollouts within 1e-5. LLaVA 1.5 and LLaVA-OneVision: the engine stops at weight loading (VLLM_CANNOT_LOAD)."""
    model_dir = tiny_vlm_dir(arch)
    if arch in VLLM_CANNOT_LOAD:
        with pytest.raises(ValueError, match=r"no module or parameter named 'vision_tower\.embeddings'"):
            record_run(monkeypatch, MDIGRPOTrainer, model_dir, mdi_args(tmp_path), zen_image_dataset(8))
        return
    rec = record_run(monkeypatch, MDIGRPOTrainer, model_dir, mdi_args(tmp_path), zen_image_dataset(8))
    assert rec.generations == 2 and rec.forwards == [1, 1]
    assert_engine_ran_the_scored_prompt(rec, arch, suppressed_offsets(rec, model_dir))
    n_image = assert_probe_equals_eager(rec, model_dir)
    assert all(n > 0 for batch in n_image for n in batch)


def test_lora_adapter_is_merged_into_the_engine_at_each_sync(tiny_vlm_dir, tmp_path, monkeypatch):
    """LoRA under vLLM: TRL merges the adapter into the weights it sends, so after the run each adapted layer of the
    engine holds W + (alpha / r) B A of the policy as of the last sync (B trained away from its zero start), the
    probe still rides TRL's forward (one policy forward per batch) and measures every batch."""
    from peft import LoraConfig

    model_dir = tiny_vlm_dir("qwen2_5_vl")
    r, alpha = 4, 8
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=r".*language_model.*\.(o_proj|down_proj)")
    rec = record_run(monkeypatch, MDIGRPOTrainer, model_dir, mdi_args(tmp_path), zen_image_dataset(8),
                     peft_config=config)
    assert rec.generations == 2 and rec.forwards == [1, 1] and len(rec.attention) == 2
    synced = rec.first_forward[1]["state"]  # the policy the second batch was generated and scored with
    assert rec.engine_unfused
    for name, engine in rec.engine_unfused.items():
        layer = name.split("layers.", 1)[1].removesuffix(".weight")  # e.g. "0.self_attn.o_proj"
        base = next(k for k in synced if "language_model" in k and k.endswith(f"layers.{layer}.base_layer.weight"))
        a = synced[base.replace("base_layer.weight", "lora_A.default.weight")]
        b = synced[base.replace("base_layer.weight", "lora_B.default.weight")]
        assert b.abs().max() > 0, f"{layer}: LoRA B still zero, the comparison would not see a missing merge"
        merged = synced[base] + (alpha / r) * b @ a
        err = (engine - merged).abs().max().item()
        assert err < 1e-6, f"{layer}: engine differs from the merged policy weight by {err:.2e}"


def mixed_image_dataset():
    """Four prompts that one batch holds together: one image, two images of different sizes, no image, and one
    image of a third size (huggingface/trl#6401: images of different sizes in one colocate batch crashed M-RoPE or
    silently corrupted prompts)."""
    from datasets import Dataset

    from fixtures.testing import shape_image

    images = [[shape_image(56, 1)], [shape_image(56, 2), shape_image(84, 3)], [], [shape_image(112, 4)]]
    prompts = [[{"role": "user", "content": q}] for q in
               ("What colour is the shape?", "Compare the two pictures.", "Name a colour.", "Is the shape round?")]
    return Dataset.from_dict({"prompt": prompts, "images": images})


def test_images_of_different_sizes_several_per_row_and_text_only_rows_in_one_batch(tiny_vlm_dir, tmp_path,
                                                                                   monkeypatch):
    """One batch mixes a one-image row, a two-image row (two sizes), a text-only row and a larger image: vLLM
    generates without error, every row's sampling log-probs equal the policy's in both batches (each prompt, one image
    placeholder per image, reached the engine as the trainer scores it, text-only rows beside image rows of several
    sizes; the second batch reuses the first one's images after a weight sync: without the trainer dropping vLLM's
    cached image features before each sync, its image rows differ by up to 0.19), every row holds the image tokens of its images, and the probe equals eager
    attention on each row."""
    from transformers import AutoConfig

    model_dir = tiny_vlm_dir("qwen2_5_vl", max_pixels=112 * 112)  # a pixel budget that keeps each size apart
    image_ids = torch.tensor(image_token_ids(AutoConfig.from_pretrained(model_dir)))
    args = mdi_args(tmp_path, per_device_train_batch_size=8, num_generations=2)
    rec = record_run(monkeypatch, MDIGRPOTrainer, model_dir, args, mixed_image_dataset())
    assert rec.generations == 2 and len(rec.logs) == 2
    offsets = suppressed_offsets(rec, model_dir)
    for sampled, policy, fwd, offset in zip(rec.sampling_logps, rec.policy_logps, rec.first_forward, offsets):
        policy = policy + offset.to(policy.dtype)
        text_only = [i for i in range(len(sampled)) if not torch.isin(fwd["input_ids"][i], image_ids).any()]
        assert len(text_only) == 2  # the text-only prompt's 2 rollouts
        diffs = [(torch.tensor(sampled[i]) - policy[i, :len(sampled[i])]).abs().max().item()
                 for i in range(len(sampled))]
        n_img = torch.isin(fwd["input_ids"], image_ids).sum(1).tolist()
        # every row, with 0, 1 or 2 images: exactly what the policy computes
        assert max(diffs) < LOGP_TOL, f"|vLLM - policy| log-prob per row: {diffs}, image tokens per row {n_img}"
    n_image = assert_probe_equals_eager(rec, model_dir)
    # 4 image tokens for 56 px, 9 for 84, 16 for 112 (patch 14, merge 2); none on the text-only row (in each batch, 2 rollouts
    # per prompt, in the sampler's order).
    for batch in n_image:
        assert sorted(set(batch)) == sorted({0, 4, 4 + 9, 16}), batch


def test_glm4v_trains_under_vllm_and_its_probe_equals_eager(tiny_vlm_dir, tmp_path, monkeypatch):
    """GLM-4.1V (begin/end-of-image tokens around its M-RoPE run), as Qwen2-VL above: vLLM generates from the prompt the
    trainer scores (log-probs equal the policy's, also after the first weight sync), no added policy forward, probe
    equal to eager attention on vLLM's rollouts within 1e-5. (Seen failing with a config lacking
    text_config.attention_bias: vLLM then builds the decoder without the q/k/v biases transformers always has, and the
    second batch differed by up to 7.9e-3 once training had moved them. Mistral 3 is refused under colocate mode:
    tests/test_vllm_prompts.py.)"""
    model_dir = tiny_vlm_dir("glm4v")
    rec = record_run(monkeypatch, MDIGRPOTrainer, model_dir, mdi_args(tmp_path), zen_image_dataset(8))
    assert rec.generations == 2 and rec.forwards == [1, 1]
    assert_engine_ran_the_scored_prompt(rec, "glm4v", suppressed_offsets(rec, model_dir))
    n_image = assert_probe_equals_eager(rec, model_dir)
    assert all(n > 0 for batch in n_image for n in batch)


def test_qwen3_vl_moe_is_refused_on_vllms_cpu_build(tiny_vlm_dir, tmp_path):
    """vLLM 0.31's CPU build cannot start Qwen3-VL-MoE in TRL's colocate mode: its fused-MoE layer asks for the expert
    parallel group, which is not initialized in this engine (an AssertionError while the engine starts, seen when
    this family was added). The trainer refuses it at construction with the reason and the fix
    (``vllm_prompts.VLLM_CPU_CANNOT_START``). The prompt the trainer would hand the engine is checked in
    tests_vllm/test_prompt_ids.py."""
    with pytest.raises(ValueError, match=r"cannot run 'qwen3_vl_moe' on vLLM's CPU build: .*expert parallel group"):
        MDIGRPOTrainer(str(tiny_vlm_dir("qwen3_vl_moe")), reward_funcs=[spread_reward], args=mdi_args(tmp_path),
                       train_dataset=zen_image_dataset(8))
