"""The probe on a GPU, prepared on the CPU (issue 46, item 3).

1. ``_ProbeState.record`` (one call per text layer) makes no host-device copy and no implicit synchronisation: every
   per-forward tensor is moved and cast once per forward, and masses, the per-token map and the per-image map rows
   stay on the device until ``result()``. On the CPU a ``.cpu()`` or an ``.item()`` costs nothing, so the calls are
   counted (:class:`HostDeviceTraffic`: patched tensor methods for what never reaches the dispatcher on the CPU, a
   ``TorchDispatchMode`` for the synchronising operators), per ``record()`` call.
2. The two exact routes (``trl_mdi.attention.routes``: the indicator-value SDPA call and flex attention's
   log-sum-exp per key group) give the same masses, token maps and per-image maps on every family, padded and not;
   the indicator route equals eager attention weights on every family (tests/test_families.py), so both do.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fixtures.testing import eager_masses, family_params, grpo_batch, shape_image
from fixtures.tiny import TINY_ARCHS
from trl_mdi.attention import measure_modality_attention, routes
from trl_mdi.attention import probe as probe_module
from trl_mdi.attention.model_facts import model_facts
from trl_mdi.attention.routes import ROUTES

MODEL_KEYS = ("input_ids", "attention_mask", "completion_mask")
# Tensor methods that copy between host and device, or force the host to wait for the device (a value read on the
# host). On a GPU each is a synchronisation; on the CPU most never reach the dispatcher, hence patched here.
COPY_METHODS = ("cpu", "cuda", "numpy")
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")
# Operators that read a device value on the host (a scalar, or a data-dependent output size).
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique")


class HostDeviceTraffic(TorchDispatchMode):
    """Counts, inside its ``with`` block, the calls that copy between host and device (``copy``), read a device value
    on the host (``sync``: ``.item()``, ``bool(t)``, boolean-mask indexing, ``nonzero`` ...), or move / cast a tensor
    with ``.to`` (``to``: a host-device copy when the device changes, a cast otherwise). Tensor methods are patched
    for the block only: what the model runs outside it is untouched."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = False  # set while code that is not the probe's own runs inside the block
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = func._schema.name
        bool_index = name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
            torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) if i is not None)
        if name in SYNC_OPS or bool_index:
            self.counts[f"sync:{name}{' (bool index)' if bool_index else ''}"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for kind, names in (("copy", COPY_METHODS), ("sync", SYNC_METHODS), ("to", ("to",))):
            for name in names:
                self._saved[name] = torch.Tensor.__dict__.get(name)
                original = getattr(torch.Tensor, name)

                def counted(t, *a, _key=f"{kind}:{name}", _original=original, **kw):
                    if not self.paused:
                        self.counts[_key] += 1
                    return _original(t, *a, **kw)

                setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, value in self._saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)
        self._saved = {}
        return super().__exit__(*exc)


def _count_per_record(monkeypatch, run) -> list[list[collections.Counter]]:
    """Runs ``run()`` and returns, per forward of the model, the traffic counted inside each ``record()`` call.

    Flex attention's kernel and block-mask builder run outside the count: their eager CPU path compiles itself, which
    torch refuses under a dispatch mode (on a GPU they are one compiled kernel each, launched without a sync)."""
    forwards: list[list[collections.Counter]] = []
    active: list[HostDeviceTraffic] = []
    begin, record = probe_module._ProbeState.begin_call, probe_module._ProbeState.record

    def begin_call(state, kwargs):
        forwards.append([])
        return begin(state, kwargs)

    def counted_record(state, *args, **kwargs):
        traffic = HostDeviceTraffic()
        active[:] = [traffic]
        try:
            with traffic:
                return record(state, *args, **kwargs)
        finally:
            forwards[-1].append(traffic.counts)
            active.clear()

    for name in ("flex_lse", "group_block_masks"):
        original = getattr(routes, name)

        def uncounted(*a, _original=original, **kw):
            for t in active:
                t.paused = True
            try:
                with _disable_current_modes():
                    return _original(*a, **kw)
            finally:
                for t in active:
                    t.paused = False

        monkeypatch.setattr(routes, name, uncounted)
    monkeypatch.setattr(probe_module._ProbeState, "begin_call", begin_call)
    monkeypatch.setattr(probe_module._ProbeState, "record", counted_record)
    run()
    return forwards


def _load(path):
    from transformers import AutoModelForImageTextToText

    # the family's default attention (transformers loads a soft-capped Gemma 2 decoder, PaliGemma 2's, eager)
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def _batches(processor, facts=None):
    # PaliGemma's processor refuses a text-only row and takes unequal prompts one at a time (``facts``)
    middle = shape_image(56, 3) if facts is not None and facts.image_in_every_prompt else None
    padded = grpo_batch(processor, ["What colour is the shape in the image? Answer with a letter.", "How many shapes?",
                                    "Shape?"], [shape_image(56, 1), middle, shape_image(56, 2)], [5, 2, 7], seed=3,
                        facts=facts)
    single = grpo_batch(processor, ["Which shape is it?"], [shape_image(56, 4)], [6], seed=4,  # no padding: no mask
                        facts=facts)
    return {"padded": padded, "single": single}


@pytest.fixture(scope="module")
def qwen(tiny_vlm_dir):
    from transformers import AutoProcessor

    path = tiny_vlm_dir("qwen2_5_vl")
    return path, _load(path), AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", ["padded", "single"])
def test_record_makes_no_host_device_copy_or_sync_per_layer(qwen, monkeypatch, route, layout):
    path, model, processor = qwen
    batch = _batches(processor)[layout]

    def run():
        # Two forwards, with the per-token map and a per-image map row: every path of record() runs.
        for _ in range(2):
            measure_modality_attention(model, **batch, route=route, image_map_rows=[0], token_segment="late")

    forwards = _count_per_record(monkeypatch, run)
    n_layers = model.config.text_config.num_hidden_layers
    assert len(forwards) == 2 and all(len(f) == n_layers for f in forwards)
    for per_layer in forwards:
        # The first layer moves and casts the forward's inputs once (``.to`` only: no copy to the host, no sync) ...
        first = per_layer[0]
        assert first and set(first) <= {"to:to"}, first
        # ... and every later layer adds device work only.
        later = [dict(c) for c in per_layer[1:] if c]
        assert later == [], f"per-layer host-device traffic ({route}, {layout}): {later}"


def test_the_counter_sees_what_it_counts():
    """The counter is not blind on the CPU: each kind of call it looks for is counted (a test of the test)."""
    traffic = HostDeviceTraffic()
    x = torch.arange(6.0)
    with traffic:
        x.cpu(), x.to(torch.float64), x.sum().item(), bool(x.any()), int(x[1]), x.tolist(), x[x > 2], x.nonzero()
    x.cpu()
    c = traffic.counts
    assert c["copy:cpu"] == 1 and c["to:to"] == 1 and c["sync:item"] == 1 and c["sync:__bool__"] == 1
    assert c["sync:__int__"] == 1 and c["sync:tolist"] == 1 and c["sync:nonzero"] == 1
    assert c["sync:aten::index (bool index)"] == 1 and c["sync:aten::_local_scalar_dense"] >= 3


# ------------------------------------------------------------------------------------------------
# The routes, compared
# ------------------------------------------------------------------------------------------------
FAMILIES = [(a, {}) for a in TINY_ARCHS] + [("gemma3", {"sliding_window": 8})]


@pytest.mark.parametrize("arch, kwargs", family_params(FAMILIES, ids=[f"{a}{'-window8' if k else ''}" for a, k in FAMILIES]))
def test_the_routes_agree_on_every_family(tiny_vlm_dir, arch, kwargs):
    """Masses, per-token image mass and per-image maps: the log-sum-exp route equals the indicator route (1e-5) on a
    padded batch (a boolean mask, a sliding window for Gemma) and on one unpadded row (no mask: the causal bias)."""
    from transformers import AutoProcessor

    path = tiny_vlm_dir(arch, **kwargs)
    model, processor = _load(path), AutoProcessor.from_pretrained(path)
    for name, batch in _batches(processor, model_facts(model.config)).items():
        res = {r: measure_modality_attention(model, **batch, route=r, image_map_rows=[0], token_segment="late")
               for r in ROUTES}
        a, b = res["indicator"], res["lse"]
        layers = a.layers
        assert b.layers == layers
        for field in ("image", "prompt_text", "completion", "special"):
            x, y = getattr(a, field)[:, layers], getattr(b, field)[:, layers]
            assert torch.equal(torch.isnan(x), torch.isnan(y)), (arch, name, field)
            err = (x - y).nan_to_num(0.0).abs().max().item()
            assert err < 1e-5, f"{arch} {name} {field}: max |lse - indicator| = {err:.1e}"
        torch.testing.assert_close(b.query_image_mass, a.query_image_mass, atol=1e-5, rtol=0)
        assert a.image_token_mass.keys() == b.image_token_mass.keys()
        for row in a.image_token_mass:
            torch.testing.assert_close(b.image_token_mass[row], a.image_token_mass[row], atol=1e-5, rtol=0)


@pytest.mark.parametrize("route", ROUTES)
def test_each_route_equals_eager_attention(qwen, route):
    """Directly against materialised eager weights (not only against each other), padded and unpadded."""
    path, model, processor = qwen
    from transformers import AutoModelForImageTextToText

    eager = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    for name, batch in _batches(processor).items():
        res = measure_modality_attention(model, **batch, route=route)
        ref, _ = eager_masses(eager, batch)
        got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1)[:, res.layers]
        err = (got.double() - ref).nan_to_num(0.0).abs().max().item()
        assert err < 1e-5, f"{route} {name}: max |probe - eager| = {err:.1e}"


def test_an_unknown_route_is_refused(qwen):
    _, model, processor = qwen
    with pytest.raises(ValueError, match="probe route must be one of"):
        measure_modality_attention(model, **_batches(processor)["single"], route="fast")
