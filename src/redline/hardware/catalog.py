"""The GPU catalog: datasheet peaks, memory and power of each GPU, every row with its source.

The rows live in ``catalog.toml`` next to this module, as data. ``find_gpu`` maps the name torch
reports to a row; an unknown name gives ``None``, never a near match, because a wrong peak makes a
confident, wrong MFU (a B300 read as an A100 showed 88% MFU where the truth was 12%:
https://github.com/allenai/OLMo-core/pull/817). ``gpus_named`` finds the rows a person means by what
they type; ``nearest_gpus`` only suggests rows for an error message, and is never taken as a match.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

from redline.errors import ConfigError, invalid

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML through the tomli backport
    import tomli as tomllib

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]  # the values of redline.plan.precision.PrecisionName
PRECISIONS: tuple[str, ...] = get_args(Precision)

# Which peak a training precision runs at (fp32 moves to the TF32 peak when TF32 is on).
_PEAK_FIELDS: dict[str, str] = {
    "fp32": "peak_tflops_fp32",
    "tf32": "peak_tflops_tf32",
    "bf16-mixed": "peak_tflops_bf16",
    "fp16-mixed": "peak_tflops_fp16",
}
_OPTIONAL_NUMBERS = (
    "tdp_w",
    "peak_tflops_fp32",
    "peak_tflops_tf32",
    "peak_tflops_bf16",
    "peak_tflops_fp16",
    "peak_tflops_fp8",
)


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One GPU SKU as its datasheet gives it; a peak the sources do not give is ``None``.

    Peaks are dense TFLOP/s (no 2:4 sparsity); bf16 and fp16 are tensor-core rates with FP32
    accumulate. ``match`` holds the names torch reports for the SKU, ``*`` standing for any text.
    ``mem_gib`` is the datasheet's size; ``usable_gib`` what torch's ``total_memory`` reads on the card
    (ECC and the driver keep the rest), read where ``usable_source`` says, or ``None`` where none was found.
    """

    id: str
    name: str
    architecture: str
    compute_capability: tuple[int, int]
    match: tuple[str, ...]
    mem_gib: float
    mem_bw_gbs: float
    source: str
    tdp_w: float | None = None
    peak_tflops_fp32: float | None = None
    peak_tflops_tf32: float | None = None
    peak_tflops_bf16: float | None = None
    peak_tflops_fp16: float | None = None
    peak_tflops_fp8: float | None = None
    usable_gib: float | None = None
    usable_source: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        for name in ("id", "name", "architecture"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise invalid(name, value, "a non-empty string")
        if not isinstance(self.note, str):
            raise invalid("note", self.note, "a string")
        if not isinstance(self.source, str) or not self.source.startswith("https://"):
            raise invalid("source", self.source, "an https:// URL of the vendor's datasheet")
        cc = self.compute_capability
        if not (isinstance(cc, tuple) and len(cc) == 2 and all(_is_int(v) and v >= 0 for v in cc)):
            raise invalid("compute_capability", cc, "two non-negative integers, [major, minor] such as [9, 0]")
        if not self.match or not all(isinstance(p, str) and p.strip() for p in self.match):
            raise invalid("match", self.match, "a non-empty list of non-empty name patterns")
        for name in ("mem_gib", "mem_bw_gbs"):
            if not _is_positive(getattr(self, name)):
                raise invalid(name, getattr(self, name), "a positive number")
        for name in _OPTIONAL_NUMBERS:
            value = getattr(self, name)
            if value is not None and not _is_positive(value):
                raise invalid(name, value, "a positive number, or the field left out when no source gives it")
        self._check_usable()

    def _check_usable(self) -> None:
        """What torch reads on the card: no more than the card has, and sourced where given."""
        if self.usable_gib is not None and not (_is_positive(self.usable_gib) and self.usable_gib <= self.mem_gib):
            raise invalid(
                "usable_gib", self.usable_gib, f"a positive number no larger than mem_gib ({self.mem_gib:g})",
                "what torch's total_memory reads on the card, in GiB; leave it out where no source gives it",
            )  # fmt: skip
        text = self.usable_source
        if not isinstance(text, str) or bool(text.strip()) != (self.usable_gib is not None):
            raise invalid(
                "usable_source", self.usable_source, "where usable_gib was read, given with it and only with it",
                "a thread quoting the reading, or 'as <id>' for a row of the same memory whose reading is taken",
            )  # fmt: skip

    @property
    def weighed_gib(self) -> float:
        """The GiB a step may be weighed against on this card: what torch reads on it, else the datasheet's size."""
        return self.mem_gib if self.usable_gib is None else self.usable_gib


_FIELDS = {f.name for f in fields(GPUSpec)}
_REQUIRED = {"id", "name", "architecture", "compute_capability", "match", "mem_gib", "mem_bw_gbs", "source"}


def peak_tflops(spec: GPUSpec | None, precision: str, *, tf32: bool) -> float | None:
    """Return the dense peak TFLOP/s that a run at ``precision`` can reach on ``spec``, or None if unknown.

    ``tf32`` says whether fp32 matmuls run on TF32 tensor cores (the Plan's tf32 choice); it only
    matters for ``precision="fp32"``.
    """
    if precision not in PRECISIONS:
        raise invalid("precision", precision, f"one of {', '.join(map(repr, PRECISIONS))}")
    if spec is None:
        return None
    key = "tf32" if precision == "fp32" and tf32 else precision
    value: float | None = getattr(spec, _PEAK_FIELDS[key])
    return value


def find_gpu(name: str, *, catalog: Iterable[GPUSpec] | None = None) -> GPUSpec | None:
    """Return the catalog row whose pattern matches ``name`` most specifically, or None.

    A pattern matches the whole name, ignoring case and repeated spaces; the most specific is the one
    with the most literal characters. An unknown name, or a tie between two rows, gives None.
    """
    wanted = _normalise(name)
    best: list[tuple[int, GPUSpec]] = []
    for spec in load_catalog() if catalog is None else catalog:
        scores = [_specificity(p) for p in spec.match if _pattern(p).fullmatch(wanted)]
        if scores:
            best.append((max(scores), spec))
    if not best:
        return None
    best.sort(key=lambda item: item[0], reverse=True)
    if len(best) > 1 and best[0][0] == best[1][0]:
        return None  # two rows fit equally well: refusing beats guessing
    return best[0][1]


_MIG = re.compile(r"(.+?)\s+MIG\s+\d+g\.\d+gb", re.IGNORECASE)  # "NVIDIA H100 80GB HBM3 MIG 1g.10gb"


def mig_parent(name: str, *, catalog: Iterable[GPUSpec] | None = None) -> GPUSpec | None:
    """The catalog row of the card that ``name``, a MIG slice's name as torch reports it, is a slice of; None where
    ``name`` is no MIG slice or its card is unknown. A slice's share of the card's peak is not in any datasheet."""
    slice_of = _MIG.fullmatch(" ".join(name.split()))
    return find_gpu(slice_of.group(1), catalog=catalog) if slice_of else None


def gpus_named(name: str, *, catalog: Iterable[GPUSpec] | None = None) -> list[GPUSpec]:
    """Return the rows a person may mean by ``name``: the row of that id, the row of the name torch reports,
    else every row whose id, name or reported name holds each of ``name``'s words ("RTX 4090", "h200", "Tesla V100"),
    its memory among them ("T4 16GB", "A100 80GB"); a word may join neighbouring words of the row ("rtx4090",
    "h100nvl").

    Rows that ``name`` names whole (each word of their id, or of their name, typed) come alone when there
    are any: "rtx 6000" is part of rtx-6000-ada's name, but so it is of the Quadro RTX 6000 the catalog
    lacks, and ``names_whole`` tells the two cases apart."""
    specs = tuple(load_catalog() if catalog is None else catalog)
    wanted = set(_words(name))
    by_id = [s for s in specs if set(_words(s.id)) == wanted]
    found = by_id or [s for s in [find_gpu(name, catalog=specs)] if s is not None]
    if found:
        return found
    family = architecture_named(name, catalog=specs)
    if family is not None:  # every row of it: "hopper" is in the GH200's name ("Grace Hopper") but not the H100's
        return [s for s in specs if s.architecture == family]
    sizes = {w for w in wanted if _MEMORY.fullmatch(w)}
    reported = find_gpu(_without_memory(name), catalog=specs) if sizes else None
    if reported is not None and all(_its_memory(w, reported) for w in sizes):
        return [reported]  # the name torch reports, with the memory: "NVIDIA H200 141GB" (the NVL has 141 GB too)
    held = [s for s in specs if wanted and all(_holds(s, w) for w in wanted)]
    whole = [s for s in held if names_whole(name, s)]
    return whole or held


def architecture_named(name: str, *, catalog: Iterable[GPUSpec] | None = None) -> str | None:
    """The architecture of the catalog that ``name`` is made of the words of ("hopper", "Ada", "ada lovelace",
    "cdna3"), or None where it names none."""
    wanted = set(_words(name))
    if not any(char.isalpha() for word in wanted for char in word):  # "3" is a word of "CDNA 3", not its name
        return None
    for family in dict.fromkeys(s.architecture for s in (load_catalog() if catalog is None else catalog)):
        if wanted <= _terms(family):
            return family
    return None


def names_whole(name: str, spec: GPUSpec) -> bool:
    """Whether ``name`` holds every word of ``spec``'s id or of its name (the vendor's aside), so it can mean no
    other card: "rtx 4090" and "h100nvl" do, "4090" (a laptop's 4090 has 16 GB) and "rtx 6000" do not."""
    reported = (find_gpu(given, catalog=[spec]) for given in (name, _without_memory(name)))
    if set(_words(name)) == set(_words(spec.id)) or spec in reported:
        return True
    typed, terms = _compact(name), _terms(name)
    if "sxm" in terms:  # the A100 is sold in SXM4 form only and the H100 in SXM5; the V100 in SXM2 and SXM3 both
        terms |= {"sxm4", "sxm5"}
    for label in (spec.id, spec.name):
        words = [word for word in _words(label) if word != "nvidia"]
        if words and (set(words) <= terms or "".join(words) in typed):
            return True
    return False


def nearest_gpus(name: str, *, count: int = 3, catalog: Iterable[GPUSpec] | None = None) -> list[GPUSpec]:
    """Return up to ``count`` rows whose id or name reads most like ``name`` (a typo, a card one letter off),
    closest first; none when nothing is close."""
    specs = tuple(load_catalog() if catalog is None else catalog)
    wanted = _compact(name)
    keys: dict[str, list[GPUSpec]] = {}
    for spec in specs:
        for key in dict.fromkeys((_compact(spec.id), _compact(spec.name))):
            keys.setdefault(key, []).append(spec)
    close = difflib.get_close_matches(wanted, list(keys), n=len(keys), cutoff=0.6) if wanted else []
    if not close and wanted:  # none near a whole id or name: near a family's ("h900": h100-*, h200-*)
        keys = {}
        for spec in specs:
            keys.setdefault(_compact(spec.id.split("-")[0]), []).append(spec)
        close = difflib.get_close_matches(wanted, list(keys), n=len(keys), cutoff=0.6)
    # first the rows the name holds but for its memory ("B200 192GB": the b200 of 180 GB), then by spelling
    bare = _without_memory(name)
    named = gpus_named(bare, catalog=specs) if bare != " ".join(_words(name)) else []
    nearest = list(dict.fromkeys([*named, *(spec for key in close for spec in keys[key])]))  # each once, closest first
    return nearest[:count]


def load_catalog(path: str | Path | None = None) -> tuple[GPUSpec, ...]:
    """Return the rows of ``path``, or of the packaged catalog (read once, then cached).

    A malformed row raises ConfigError naming the row and the field.
    """
    if path is None:
        return _packaged_catalog()
    where = Path(path)
    return _parse(where.read_text(encoding="utf-8"), origin=str(where))


@functools.cache
def _packaged_catalog() -> tuple[GPUSpec, ...]:
    text = resources.files("redline.hardware").joinpath("catalog.toml").read_text(encoding="utf-8")
    return _parse(text, origin="redline/hardware/catalog.toml")


def _parse(text: str, *, origin: str) -> tuple[GPUSpec, ...]:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin} is not valid TOML: {exc}") from exc
    rows = document.get("gpu")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{origin} has no [[gpu]] rows\nhint: each SKU is a [[gpu]] table; see catalog.toml")
    specs = tuple(_row(row, f"{origin}: [[gpu]] row {i + 1}") for i, row in enumerate(rows))
    _check_unique(specs, origin)
    _check_borrowed_readings(specs, origin)
    return specs


def _row(row: Any, where: str) -> GPUSpec:
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where} is not a table")
    label = f"{where} (id={row['id']!r})" if "id" in row else where
    unknown = sorted(set(row) - _FIELDS)
    if unknown:
        raise ConfigError(f"{label}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(_FIELDS))}")
    missing = sorted(_REQUIRED - set(row))
    if missing:
        raise ConfigError(f"{label}: field {missing[0]!r} is missing; every row needs {', '.join(sorted(_REQUIRED))}")
    values = dict(row)
    for name in ("compute_capability", "match"):
        if isinstance(values[name], list):
            values[name] = tuple(values[name])
    try:
        return GPUSpec(**values)
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from None


def _check_unique(specs: tuple[GPUSpec, ...], origin: str) -> None:
    ids: set[str] = set()
    owners: dict[str, str] = {}
    for spec in specs:
        if spec.id in ids:
            raise ConfigError(f"{origin}: id {spec.id!r} appears twice; each row needs its own id")
        ids.add(spec.id)
        for pattern in spec.match:
            key = _normalise(pattern)
            if key in owners and owners[key] != spec.id:
                raise ConfigError(
                    f"{origin}: match pattern {pattern!r} is in rows {owners[key]!r} and {spec.id!r}; "
                    "a name must lead to one row"
                )
            owners[key] = spec.id


def _check_borrowed_readings(specs: tuple[GPUSpec, ...], origin: str) -> None:
    """A row whose usable_source is "as <id>" takes that row's reading: the row must exist, read for itself, and
    hold the same memory, so a borrowed figure cannot drift from the one it was taken from."""
    by_id = {spec.id: spec for spec in specs}
    for spec in specs:
        borrowed = re.match(r"as ([\w-]+)", spec.usable_source)  # "as h100-sxm: the same GH100 chip ..."
        if borrowed is None:
            continue
        lender = by_id.get(borrowed.group(1))
        memory = (spec.mem_gib, spec.usable_gib)
        if lender is None or lender.usable_source.startswith("as ") or (lender.mem_gib, lender.usable_gib) != memory:
            raise ConfigError(
                f"{origin}: row {spec.id!r} takes usable_gib {spec.usable_gib!r} 'as {borrowed.group(1)}', which is "
                "no row reading the same mem_gib and usable_gib for itself\nhint: name a row with the same memory "
                "and the reading, or give this row's own source"
            )


def _words(text: str) -> list[str]:
    """``text``'s words, lower case, a memory size written as one ("16 GB" -> "16gb")."""
    joined = re.sub(r"(\d)\s+(gi?b)\b", r"\1\2", text.casefold())
    return [word for word in re.split(r"[^0-9a-z.]+", joined) if word]


def _terms(text: str) -> set[str]:
    """``text``'s words, and each run of two or three of them written together ("rtx 4090" -> "rtx4090")."""
    words = _words(text)
    joined = {"".join(words[i:j]) for i in range(len(words)) for j in range(i + 2, min(i + 3, len(words)) + 1)}
    return set(words) | joined


def _row_terms(spec: GPUSpec) -> set[str]:
    """The words a person may type for ``spec``: its id's, its name's, those of the names torch reports for it
    ("tesla", "hbm3"), each with its neighbours joined, and its memory ("16gb")."""
    labels = (spec.id, spec.name, *(pattern.replace("*", " ") for pattern in spec.match))
    return set().union(*map(_terms, labels)) | {f"{spec.mem_gib:g}gb"}


def _holds(spec: GPUSpec, word: str) -> bool:
    """Whether a typed ``word`` is one of ``spec``'s terms, its memory, or the start of a term of letters and
    digits that begins with letters ("sxm" of "sxm4"; never "a10" of "a100", a card of its own)."""
    terms = _row_terms(spec)
    if word in terms or _its_memory(word, spec):
        return True
    return word.isalpha() and len(word) >= 3 and any(t.startswith(word) and t[len(word)].isdigit() for t in terms
                                                     if len(t) > len(word))  # fmt: skip


def _without_memory(name: str) -> str:
    """``name``'s words without its memory sizes: "NVIDIA H200 141GB" -> "nvidia h200"."""
    return " ".join(w for w in _words(name) if not _MEMORY.fullmatch(w))


_MEMORY = re.compile(r"(\d+(?:\.\d+)?)gi?b")  # a memory size as typed: "80gb", "15gib"


def _its_memory(word: str, spec: GPUSpec) -> bool:
    """Whether ``word`` is ``spec``'s memory as the card reports it: "15gb" for a 16 GB T4, "79gb" for an 80 GB
    H100 (the driver keeps some back), within a tenth below the size sold."""
    size = _MEMORY.fullmatch(word)
    return size is not None and 0.9 * spec.mem_gib <= float(size.group(1)) <= spec.mem_gib


def _compact(text: str) -> str:
    """``text`` without case, spaces or punctuation, and without the vendor's name: what a typo is measured on."""
    return "".join(word for word in _words(text) if word != "nvidia")


def _normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


@functools.cache
def _pattern(pattern: str) -> re.Pattern[str]:
    parts = _normalise(pattern).split("*")
    return re.compile(".*".join(re.escape(part) for part in parts))


def _specificity(pattern: str) -> int:
    return len(_normalise(pattern).replace("*", ""))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(value: object) -> bool:
    # bool is an int subclass: `tdp_w = true` is a typo, not 1 W.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
