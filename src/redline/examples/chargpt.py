"""``example:chargpt``: a small character-level GPT that learns the Python standard library's docstrings.

The corpus is real English-and-code text that every Python install already has, so the example needs
no download. It is gathered from a fixed, sorted list of pure-Python modules, so it is the same on
every run with the same Python version (docstrings change between Python versions).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import warnings
from dataclasses import dataclass, replace
from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.optimizer import ParamsT
from torch.utils.data import Dataset

from redline.config import positive_int
from redline.errors import ConfigError, invalid
from redline.examples.gpt import GPT, GPTConfig
from redline.task import Task

# Pure-Python modules only: a C module's docstrings are terse signatures rather than prose.
CORPUS_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "codecs", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib", "doctest", "email.message", "enum",
    "fractions", "ftplib", "functools", "gettext", "glob", "heapq", "http.client", "http.server", "imaplib",
    "inspect", "ipaddress", "json", "logging", "optparse", "pathlib", "pickle", "pprint", "queue", "random",
    "shutil", "smtplib", "socketserver", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "traceback", "typing", "unittest.case", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip
SAMPLE_PROMPT = "Return the "
SAMPLE_CHARS = 200
NOT_FINITE = " [no sample: the model's outputs hold NaN or inf; its training diverged]"


def chargpt(
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 128,
    block_size: int = 64,
    batch_size: int = 32,
    epochs: int = 1,
    lr: float = 1e-3,
    dropout: float = 0.0,
    max_chars: int = 400_000,
    seed: int = 0,
) -> Task:
    """Return the chargpt Task: next-character prediction on stdlib docstrings, 90% train / 10% val.

    The defaults train in well under a minute on a laptop CPU; n_layer=12, n_head=12, n_embd=768,
    block_size=1024 gives GPT-2 small's shape (with a ~100-character vocabulary). ``seed`` fixes the
    text that ``task.sample`` generates; the model factory seeds nothing.
    """
    # Built first so bad model options fail before the corpus is gathered; vocab_size comes later.
    config = GPTConfig(
        vocab_size=1, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout
    )
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise invalid("lr", lr, "a finite number > 0", "1e-3 suits the default size; try 6e-4 for GPT-2 small")
    positive_int("max_chars", max_chars)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise invalid("seed", seed, "an integer")

    text = stdlib_docstrings()[:max_chars]
    vocab = CharVocab.from_text(text + SAMPLE_PROMPT)  # the prompt's characters must be encodable
    data = torch.tensor(vocab.encode(text), dtype=torch.long)
    split = int(0.9 * len(data))
    train, val = CharBlocks(data[:split], block_size), CharBlocks(data[split:], block_size)
    if len(val) == 0:
        raise invalid(
            "max_chars",
            max_chars,
            f"enough text for one validation block of {block_size + 1} characters "
            f"(the last 10% of the {len(text):,} characters used is {len(data) - split:,})",
            f"raise max_chars to at least {10 * (block_size + 1) + 10} or lower block_size",
        )

    config = replace(config, vocab_size=vocab.size)

    def optimizer(params: ParamsT) -> torch.optim.Optimizer:
        # betas=(0.9, 0.99) as in nanoGPT's shakespeare_char: small batches, few tokens per step.
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99))

    return Task(
        model=functools.partial(GPT, config),
        loss_fn=next_char_loss,
        train_data=train,
        val_data=val,
        optimizer=optimizer,
        batch_size=batch_size,
        sample=CharSampler(vocab=vocab, block_size=block_size, seed=seed),
        epochs=epochs,
        name="chargpt",
    )


def next_char_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Return the mean cross entropy of logits (B, T, V) against next-character ids (B, T)."""
    # float(): a model run in bf16 or fp16 without autocast would otherwise take the softmax in low precision.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass(frozen=True)
class CharVocab:
    """Characters <-> ids; the ids are positions in the sorted character set."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        return len(self.chars)

    @functools.cached_property
    def _ids(self) -> dict[str, int]:
        return {ch: i for i, ch in enumerate(self.chars)}

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        try:
            return [ids[ch] for ch in text]
        except KeyError as exc:
            raise ConfigError(f"character {exc.args[0]!r} is not in the {self.size}-character vocabulary") from exc

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class CharBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping blocks of a token stream: item i is (x, y) = data[i*T : i*T+T], shifted by one."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        # Each block needs block_size + 1 tokens: the last target is the token after the block.
        return max(0, (len(self.data) - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} out of range for {len(self)} blocks")
        start = (index % len(self)) * self.block_size
        # clone: a view would carry the whole stream's storage with it through a DataLoader worker queue.
        chunk = self.data[start : start + self.block_size + 1].clone()
        return chunk[:-1], chunk[1:]


@dataclass(frozen=True)
class CharSampler:
    """Generate text from a fixed prompt with a fixed seed, so samples of two models compare fairly."""

    vocab: CharVocab
    block_size: int
    seed: int = 0
    prompt: str = SAMPLE_PROMPT
    num_chars: int = SAMPLE_CHARS
    temperature: float = 0.8

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> str:
        """Return the prompt followed by ``num_chars`` characters sampled from ``model``; where the model's outputs
        are not finite (NaN weights), the text so far and a note that says so."""
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        generator = torch.Generator(device=device).manual_seed(self.seed)
        idx = torch.tensor([self.vocab.encode(self.prompt)], dtype=torch.long, device=device)
        was_training = model.training
        model.eval()
        try:
            for _ in range(self.num_chars):
                logits = model(idx[:, -self.block_size :])[:, -1, :].float()
                if not torch.isfinite(logits).all():  # a diverged model: multinomial would raise, losing the summary
                    return self.vocab.decode(idx[0].tolist()) + NOT_FINITE
                probs = F.softmax(logits / self.temperature, dim=-1)
                idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        finally:
            model.train(was_training)
        return self.vocab.decode(idx[0].tolist())


@functools.lru_cache(maxsize=1)
def stdlib_docstrings() -> str:
    """Return the docstrings of CORPUS_MODULES, module by module, in sorted order, blank-line separated."""
    docs: list[str] = []
    for name in CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a trimmed Python build may lack a module (http, email); use the rest
            continue
        docs.extend(_module_docstrings(module))
    text = "\n\n".join(docs)
    if len(text) < 10_000:
        raise ConfigError(
            f"the standard library's docstrings give only {len(text):,} characters of text\n"
            "hint: Python run with -OO (or PYTHONOPTIMIZE=2) strips docstrings; run without it"
        )
    return text


def _module_docstrings(module: ModuleType) -> list[str]:
    # The module, then its public classes (each followed by its public methods) and functions, by
    # name. Only objects defined in the module itself, so a re-exported one is not counted twice.
    objects: list[object] = [module]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # typing.io and friends warn when touched
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            objects.append(obj)
            if inspect.isclass(obj):
                objects.extend(_public_methods(obj))
        docs, seen = [], set()
        for obj in objects:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and doc.strip() and id(obj) not in seen:
                seen.add(id(obj))
                docs.append(inspect.cleandoc(doc))
    return docs


def _public_methods(cls: type) -> list[object]:
    methods: list[object] = []
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            methods.append(member)
    return methods
