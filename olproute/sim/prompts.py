"""Seeded SYNTHETIC prompts for four task families, with per-model ground truth.

No public prompt dataset is available to the project, so this module writes prompts that
read like the four task families of the BEAR paper's evaluation and attaches, per model,
a true output length and a true quality that depend on the prompt in learnable but noisy
ways. Nothing here was produced by a language model; the figures are a calibrated model
of how such data behaves, not measurements.

Families (dataset they imitate; prompt length, answer length):

* ``instruction`` (Alpaca): short prompt, short answer.
* ``doc_qa`` (HotpotQA distractor): passages plus a multi-hop question; long, short.
* ``summarization`` (GovReport): a long report to summarise; long, long.
* ``creative`` (WritingPrompts): a story premise; short, long.

Ground truth, per prompt and model:

* Decode length (tokens): a default length set by the prompt (list size, document length,
  complexity) times the model's verbosity for the family; a requested length ("in about
  300 words") pulls it toward the request as far as the model complies; then lognormal
  noise shared by all models (the prompt's hidden verbosity) and per model.
* Quality in [0, 1]: ``Phi(mu - a_m * d + b * eps)`` with ``d`` the prompt's difficulty
  (topic tier and structural complexity, both visible in the text, plus a hidden part) and
  ``mu`` solved so the mean over prompts equals the BEAR paper's per-task LLM-judge score
  (App. A.1, Table 2) for Qwen3-0.6B / 8B / 32B. Other models' means are assumptions,
  marked as such in ``MODELS``. A prompt longer than a model's context loses quality.

Prompt lengths are counted by ``olproute.predict.count_tokens`` (a whitespace and
punctuation tokenizer, not a model's BPE tokenizer). Every draw uses the ``Generator``
passed in, in a fixed order, so a seed gives identical prompts and truth.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from olproute.predict import TrainingData, count_tokens
from olproute.sim.workloads import bear_ttft_targets_s
from olproute.types import Request

TASKS: tuple[str, ...] = ("instruction", "doc_qa", "summarization", "creative")
MAX_DECODE_TOKENS = 2048  # the max_tokens every synthetic request is served with


@dataclass(frozen=True, slots=True)
class ModelTruth:
    """How one model behaves on the synthetic families (tuples are in ``TASKS`` order).

    ``quality`` is the mean quality per family; ``verbosity`` multiplies the default
    decode length; ``compliance`` in [0, 1] is how far a requested length is followed (in
    log space); ``slope`` is how strongly difficulty lowers quality.
    """

    quality: tuple[float, float, float, float]
    verbosity: tuple[float, float, float, float]
    compliance: float
    slope: float
    max_context_tokens: int
    source: str


MODELS: Mapping[str, ModelTruth] = MappingProxyType({
    # quality: BEAR paper App. A.1 Table 2 (Alpaca, HotpotQA, GovReport, WritingPrompts)
    "qwen3-0.6b": ModelTruth((0.5349, 0.4098, 0.2902, 0.1773), (1.15, 1.30, 0.75, 0.70),
                             0.55, 1.0, 40960, "BEAR Table 2"),
    "qwen3-8b": ModelTruth((0.8267, 0.8828, 0.8662, 0.5747), (1.00, 1.00, 1.00, 1.00),
                           0.85, 0.8, 40960, "BEAR Table 2"),
    "qwen3-32b": ModelTruth((0.8885, 0.9269, 0.9593, 0.8069), (1.00, 0.95, 1.05, 1.10),
                            0.92, 0.7, 40960, "BEAR Table 2"),
    # assumptions, not measurements: placed by size and generation between the above
    "qwen2.5-3b": ModelTruth((0.72, 0.70, 0.62, 0.40), (1.05, 1.10, 0.90, 0.85),
                             0.70, 0.9, 32768, "assumed"),
    "qwen2-7b": ModelTruth((0.78, 0.80, 0.76, 0.50), (1.00, 1.05, 0.95, 0.95),
                           0.80, 0.85, 32768, "assumed"),
    "llama-2-7b": ModelTruth((0.66, 0.55, 0.45, 0.42), (1.10, 1.15, 0.90, 0.90),
                             0.60, 0.9, 4096, "assumed"),
})

# Difficulty d = W_TIER * tier + W_COMPLEXITY * complexity + W_HIDDEN * h (standardised
# uniform levels, h ~ N(0, 1); Var(d) = 1). Quality noise B per (prompt, model).
_W_TIER, _W_COMPLEXITY, _W_HIDDEN, _B = 0.6, 0.45, 0.66, 0.45
_TIER_LEVELS = (np.arange(4) - 1.5) / math.sqrt(1.25)
_COMPLEXITY_LEVELS = (np.arange(3) - 1.0) / math.sqrt(2.0 / 3.0)
# Length noise (log space): shared by all models of one prompt, and per model per family.
_SIGMA_PROMPT = 0.15
_SIGMA_MODEL = (0.25, 0.30, 0.18, 0.28)
_TRUNCATED_QUALITY = 0.35  # factor on quality when the prompt overflows the context
_MIN_ROOM_TOKENS = 256  # a prompt leaving less room than this in the context overflows

# -- vocabulary -------------------------------------------------------------------------
# Topics by difficulty tier: (name, subjects, content words). Higher tiers use longer,
# more technical words, as real expert prompts do.
_TOPICS: tuple[tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...], ...] = (
    (("cooking", ("baking bread at home", "a weeknight pasta dinner", "meal prep"),
      ("oven", "flour", "salt", "pan", "recipe", "dough", "sauce", "butter", "heat", "taste")),
     ("gardening", ("growing tomatoes", "a small herb garden", "composting"),
      ("soil", "seeds", "water", "sun", "leaves", "roots", "pots", "weeds", "spring", "grow")),
     ("pet care", ("training a puppy", "caring for an old cat", "keeping fish"),
      ("dog", "cat", "food", "walk", "vet", "toys", "bed", "treats", "play", "fur")),
     ("travel", ("a weekend in Lisbon", "packing for a long flight", "a road trip"),
      ("bags", "train", "map", "hotel", "beach", "city", "trip", "tickets", "food", "days"))),
    (("personal finance", ("saving for retirement", "a household budget", "paying off debt"),
      ("budget", "savings", "interest", "account", "income", "expenses", "credit", "loans",
       "spending", "goals")),
     ("world history", ("the fall of Rome", "the printing press", "the Silk Road"),
      ("empire", "trade", "kingdom", "century", "armies", "merchants", "treaty", "cities",
       "rulers", "records")),
     ("nutrition", ("a balanced breakfast", "protein for athletes", "reading food labels"),
      ("protein", "vitamins", "calories", "fiber", "sugar", "meals", "portions", "energy",
       "minerals", "hydration")),
     ("marketing", ("launching a local bakery", "email newsletters", "social media ads"),
      ("customers", "brand", "campaign", "audience", "pricing", "channels", "message",
       "sales", "growth", "feedback"))),
    (("cell biology", ("mitochondrial respiration", "protein folding", "cell division"),
      ("membrane", "organelles", "enzymes", "transcription", "ribosomes", "metabolism",
       "signaling", "chromosomes", "receptors", "cytoplasm")),
     ("software engineering", ("database indexing", "code review practices",
                               "microservice architecture"),
      ("latency", "deployment", "interfaces", "regression", "dependencies", "throughput",
       "refactoring", "concurrency", "repository", "abstraction")),
     ("climate science", ("ocean heat uptake", "carbon sequestration", "monsoon variability"),
      ("emissions", "temperature", "aerosols", "feedbacks", "circulation", "precipitation",
       "ecosystems", "projections", "radiation", "atmospheric")),
     ("contract law", ("breach of contract remedies", "consideration in contracts",
                       "force majeure clauses"),
      ("obligations", "liability", "jurisdiction", "plaintiff", "damages", "enforceability",
       "negotiation", "provisions", "precedent", "termination"))),
    (("quantum computing", ("quantum error correction", "variational eigensolvers",
                            "topological qubits"),
      ("superposition", "entanglement", "decoherence", "Hamiltonian", "eigenvalues",
       "Hilbert", "unitary", "measurement", "stabilizer", "fault-tolerant")),
     ("cryptography", ("elliptic-curve signatures", "lattice-based encryption",
                       "zero-knowledge proofs"),
      ("asymmetric", "homomorphic", "adversarial", "polynomial", "indistinguishability",
       "commitments", "discrete", "logarithm", "primitives", "authentication")),
     ("macroeconomic policy", ("quantitative easing", "fiscal multipliers",
                               "exchange-rate pass-through"),
      ("inflationary", "monetary", "equilibrium", "elasticity", "expectations", "liquidity",
       "transmission", "counterfactual", "stabilization", "heterogeneity")),
     ("number theory", ("the distribution of primes", "elliptic curves over finite fields",
                        "modular forms"),
      ("congruences", "arithmetic", "conjecture", "asymptotic", "multiplicative",
       "factorization", "approximation", "irreducible", "cohomology", "automorphic"))),
)
_VERBS = ("affects", "shapes", "limits", "supports", "changes", "drives", "reflects",
          "depends on", "improves", "reduces")
_ADJECTIVES = ("important", "recent", "common", "significant", "early", "local", "central",
               "typical", "major", "careful")
_SENTENCES = (
    "The {a} {n1} {v} the {n2} in most cases.",
    "In {year}, the {n1} {v} the {a} {n2}.",
    "Researchers noted that {n1} {v} {n2} more than expected.",
    "A {a} review of {n1} found that {n2} {v} outcomes.",
    "Because of {n1}, the {n2} {v} the wider {n3}.",
    "Several {n1} and {n2} were examined during the {a} period.",
    "The report states that {n1} {v} {n2} and {n3}.",
    "Officials said the {a} {n1} would be revised by {year}.",
)
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                 "nine", "ten")
_SYLLABLES = ("ka", "ren", "mor", "li", "ves", "tan", "dor", "el", "sa", "vik", "lo", "ber")


@dataclass(frozen=True, slots=True)
class SyntheticPrompt:
    """One generated prompt with its per-model truth (decode tokens, quality in [0, 1])."""

    text: str
    task: str
    prompt_tokens: int
    decode_tokens: Mapping[str, int]
    quality: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class _Draft:
    """Text plus what the truth needs: default and requested decode tokens, latents."""

    text: str
    default_tokens: float
    requested_tokens: float | None
    tier: int
    complexity: int


# -- text ----------------------------------------------------------------------------------
def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _count(rng: np.random.Generator, k: int) -> str:
    """``k`` as digits or as a word, as prompts write it."""
    return _NUMBER_WORDS[k] if k < len(_NUMBER_WORDS) and rng.random() < 0.5 else str(k)


def _name(rng: np.random.Generator) -> str:
    parts = rng.integers(len(_SYLLABLES), size=int(rng.integers(2, 4)))
    return "".join(_SYLLABLES[i] for i in parts).capitalize()


def _paragraph(rng: np.random.Generator, words: Sequence[str], num_sentences: int) -> str:
    picks = rng.integers(len(words), size=(num_sentences, 3))
    forms = rng.integers(len(_SENTENCES), size=num_sentences)
    extra = rng.integers(len(_ADJECTIVES), size=(num_sentences, 2))
    years = rng.integers(1950, 2024, size=num_sentences)
    return " ".join(
        _SENTENCES[forms[i]].format(
            n1=words[picks[i, 0]], n2=words[picks[i, 1]], n3=words[picks[i, 2]],
            a=_ADJECTIVES[extra[i, 0]], v=_VERBS[extra[i, 1] % len(_VERBS)],
            year=int(years[i]))
        for i in range(num_sentences))


_EXTRA_RULES = ("Use plain language.", "Include one concrete example.",
                "Avoid jargon where you can.", "End with a one-line takeaway.",
                "Do not repeat the question.", "Mention one common misconception.")


def _rules(rng: np.random.Generator, complexity: int) -> str:
    """Complexity shows in the text as extra requirements."""
    if complexity == 0:
        return ""
    chosen = rng.choice(len(_EXTRA_RULES), size=2 * complexity - 1, replace=False)
    return " " + " ".join(_EXTRA_RULES[i] for i in chosen)


def _instruction(rng: np.random.Generator, topic: tuple[str, tuple[str, ...],
                 tuple[str, ...]], tier: int, complexity: int) -> _Draft:
    name, subjects, words = topic
    subject = _pick(rng, subjects)
    rules = _rules(rng, complexity)
    bump = 1.0 + 0.15 * complexity
    form = int(rng.integers(6))
    requested: float | None = None
    if form == 0:
        k = int(rng.integers(3, 11))
        thing = _pick(rng, ("tips", "ideas", "examples", "reasons", "facts", "ways"))
        lead = _pick(rng, ("List", "Give me", "Suggest", "Name"))
        text = f"{lead} {_count(rng, k)} {thing} for {subject}.{rules}"
        default = (30.0 + 28.0 * k) * bump
    elif form in (1, 2):
        verb = "Explain" if form == 1 else "Describe"
        who = _pick(rng, ("", " to a beginner", " to a ten-year-old", " to an expert"))
        length = int(rng.integers(5))
        default = 230.0 * bump * (0.8 if who.endswith(("beginner", "old")) else 1.0)
        tail = ""
        if length == 1:
            n = int(rng.integers(2, 7))
            tail, requested = f" in {_count(rng, n)} sentences", 24.0 * n
        elif length == 2:
            tail, requested = _pick(rng, (" briefly", " in a short paragraph")), 70.0
        elif length == 3:
            tail, requested = _pick(rng, (" in detail", " in depth")), 2.2 * default
        elif length == 4:
            w = int(rng.choice((50, 100, 150, 200)))
            tail, requested = f" in under {w} words", 1.1 * w
        text = f"{verb} {subject}{who}{tail}.{rules}"
    elif form == 3:
        other = _pick(rng, [s for s in subjects if s != subject])
        text = f"Compare {subject} and {other}. What are the main differences?{rules}"
        default = 280.0 * bump
    elif form == 4:
        sentence = _paragraph(rng, words, 1)
        style = _pick(rng, ("more formal", "more casual", "more concise", "clearer"))
        text = f'Rewrite the following sentence to be {style}: "{sentence}"'
        default = 1.4 * count_tokens(sentence) + 8.0
    else:
        items = [words[i] for i in rng.choice(len(words), size=int(rng.integers(4, 9)),
                                              replace=False)]
        text = (f"Classify each of the following as related to {name} or not: "
                f"{', '.join(items)}.{rules}")
        default = 7.0 * len(items) + 12.0
    return _Draft(text, default, requested, tier, complexity)


def _doc_qa(rng: np.random.Generator, tier: int, complexity: int) -> _Draft:
    topics = _TOPICS[tier]
    num_passages = 6 + 2 * complexity + int(rng.integers(0, 3))
    entities = [_name(rng) for _ in range(num_passages)]
    passages = []
    for i, entity in enumerate(entities):
        _, subjects, words = topics[int(rng.integers(len(topics)))]
        body = _paragraph(rng, words, int(rng.integers(4, 9)))
        passages.append(f"Passage {i + 1}: {entity}\n{entity} is known for work on "
                        f"{_pick(rng, subjects)}. {body}")
    a, b = entities[0], entities[1]
    if complexity == 0:
        question = f"What is {a} known for?"
    elif complexity == 1:
        question = f"Which of {a} and {b} worked on the topic that came first?"
    else:
        c = entities[2]
        question = (f"{a} cites the work of {b}, and {b} was influenced by {c}. Which topic "
                    f"links {a} to {c}, and in which year was it first recorded?")
    style = int(rng.integers(4))
    default = 45.0 + 12.0 * complexity
    requested: float | None = None
    if style == 0:
        ask, requested = " Answer with a short phrase.", 10.0
    elif style == 1:
        ask, requested = " Answer in one sentence.", 30.0
    elif style == 2:
        ask, requested = " Explain your reasoning step by step, then give the answer.", (
            100.0 + 45.0 * complexity)
    else:
        ask = ""
    text = ("Answer the question using the passages below.\n\n" + "\n\n".join(passages)
            + f"\n\nQuestion: {question}{ask}")
    return _Draft(text, default, requested, tier, complexity)


def _summarization(rng: np.random.Generator, tier: int, complexity: int) -> _Draft:
    name, subjects, words = _TOPICS[tier][int(rng.integers(4))]
    doc_tokens = float(np.clip(rng.lognormal(math.log(2200.0 * (1.0 + 0.3 * complexity)),
                                             0.45), 700.0, 9000.0))
    num_sections = max(2, int(doc_tokens // 450))
    sentences_per = max(2, int(doc_tokens / num_sections / 14.0))
    sections = [f"## {_pick(rng, subjects).capitalize()}: findings {i + 1}\n"
                + _paragraph(rng, words, sentences_per) for i in range(num_sections)]
    title = f"Review of federal programs on {name}, {int(rng.integers(2005, 2024))}"
    form = int(rng.integers(5))
    default = 50.0 * doc_tokens ** 0.3
    requested: float | None = None
    if form == 1:
        w = int(rng.choice((150, 200, 300, 400, 500)))
        ask, requested = f" in about {w} words", 1.3 * w
    elif form == 2:
        p = int(rng.integers(2, 6))
        ask, requested = f" in {_count(rng, p)} paragraphs", 110.0 * p
    elif form == 3:
        k = int(rng.integers(4, 11))
        ask, requested = f" as {_count(rng, k)} bullet points covering the key findings", (
            35.0 * k + 20.0)
    elif form == 4:
        ask, requested = " briefly", 150.0
    else:
        ask = ""
    doc = f"Title: {title}\n\n" + "\n\n".join(sections)
    if rng.random() < 0.5:
        text = f"Summarize the following report{ask}.\n\n{doc}"
    else:
        text = f"{doc}\n\nWrite a summary of the report above{ask}."
    return _Draft(text, default, requested, tier, complexity)


def _creative(rng: np.random.Generator, tier: int, complexity: int) -> _Draft:
    name, subjects, words = _TOPICS[tier][int(rng.integers(4))]
    who = _name(rng)
    premise = _pick(rng, (
        f"You wake up to find that {_pick(rng, subjects)} has become illegal.",
        f"{who}, an expert in {name}, discovers a {_pick(rng, words)} that should not exist.",
        f"Every person is born knowing one secret about {_pick(rng, subjects)}.",
        f"The last {_pick(rng, words)} on Earth is kept in a museum guarded by {who}.",
    ))
    twists = ("Write it in the second person.", "Include a twist ending.",
              "Tell it through letters.", "Use a non-linear timeline.")
    extra = " ".join(twists[i] for i in rng.choice(len(twists), size=complexity,
                                                   replace=False))
    form = int(rng.integers(5))
    default = 650.0 * (1.0 + 0.1 * complexity)
    requested: float | None = None
    if form == 0:
        text = f"[WP] {premise}"
    elif form == 1:
        text = f"Write a story based on this prompt: {premise}"
    elif form == 2:
        text, requested = f"Write a poem about this idea: {premise}", 200.0
    elif form == 3:
        w = int(rng.choice((300, 500, 800)))
        text, requested = f"Write a short story of about {w} words. {premise}", 1.35 * w
    else:
        text, requested = f"Write a piece of flash fiction (under 250 words). {premise}", 280.0
    return _Draft(f"{text} {extra}".strip(), default, requested, tier, complexity)


def _draft(rng: np.random.Generator, task: str) -> _Draft:
    tier = int(rng.integers(4))
    complexity = int(rng.integers(3))
    if task == "instruction":
        return _instruction(rng, _TOPICS[tier][int(rng.integers(4))], tier, complexity)
    if task == "doc_qa":
        return _doc_qa(rng, tier, complexity)
    if task == "summarization":
        return _summarization(rng, tier, complexity)
    return _creative(rng, tier, complexity)


# -- truth ---------------------------------------------------------------------------------
def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def calibrated_mu(target: float, slope: float) -> float:
    """Offset ``mu`` with mean quality ``target`` over the tier and complexity levels.

    Given the levels, ``E[Phi(mu - a d + b eps)] = Phi((mu - a d_obs) / sqrt(1 + a^2 w_h^2
    + b^2))`` exactly, so the mean is a monotone function of ``mu``: solved by bisection.
    """
    scale = math.sqrt(1.0 + slope**2 * _W_HIDDEN**2 + _B**2)
    observed = [_W_TIER * t + _W_COMPLEXITY * c for t in _TIER_LEVELS
                for c in _COMPLEXITY_LEVELS]

    def mean(mu: float) -> float:
        return sum(_phi((mu - slope * d) / scale) for d in observed) / len(observed)

    lo, hi = -20.0, 20.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


def _truth(draft: _Draft, task_index: int, prompt_tokens: int, models: Sequence[str],
           mus: Mapping[str, float], rng: np.random.Generator) -> tuple[dict[str, int],
                                                                         dict[str, float]]:
    shared_len = rng.normal(0.0, _SIGMA_PROMPT)
    hidden = rng.normal()
    difficulty = (_W_TIER * _TIER_LEVELS[draft.tier]
                  + _W_COMPLEXITY * _COMPLEXITY_LEVELS[draft.complexity] + _W_HIDDEN * hidden)
    len_noise = rng.normal(0.0, _SIGMA_MODEL[task_index], size=len(models))
    q_noise = rng.normal(size=len(models))
    decode: dict[str, int] = {}
    quality: dict[str, float] = {}
    for m, model in enumerate(models):
        mt = MODELS[model]
        log_len = math.log(draft.default_tokens * mt.verbosity[task_index])
        if draft.requested_tokens is not None:
            log_len += mt.compliance * (math.log(draft.requested_tokens) - log_len)
        overflow = prompt_tokens + _MIN_ROOM_TOKENS > mt.max_context_tokens
        # an overflowing prompt is cut to fit (its answer capped), and loses quality
        room = min(MAX_DECODE_TOKENS, _MIN_ROOM_TOKENS * 2 if overflow
                   else mt.max_context_tokens - prompt_tokens)
        tokens = round(math.exp(log_len + shared_len + len_noise[m]))
        decode[model] = int(min(max(tokens, 4), room))
        q = _phi(mus[model + "/" + TASKS[task_index]] - mt.slope * difficulty
                 + _B * float(q_noise[m]))
        if overflow:
            q *= _TRUNCATED_QUALITY
        quality[model] = round(q, 4)
    return decode, quality


def _check_models(models: Sequence[str]) -> tuple[str, ...]:
    unique = tuple(dict.fromkeys(models))
    if not unique:
        raise ValueError("models must name at least one model")
    unknown = [m for m in unique if m not in MODELS]
    if unknown:
        raise ValueError(f"no synthetic truth for model(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(MODELS)})")
    return unique


def generate_prompts(
    num_prompts: int,
    models: Sequence[str],
    rng: np.random.Generator,
    task_weights: Sequence[float] | None = None,
) -> list[SyntheticPrompt]:
    """``num_prompts`` synthetic prompts with per-model truth for each of ``models``.

    Families are drawn with ``task_weights`` (in ``TASKS`` order; equal by default).
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    names = _check_models(models)
    weights = np.ones(len(TASKS)) if task_weights is None else np.asarray(task_weights, float)
    if weights.shape != (len(TASKS),) or weights.min() < 0 or weights.sum() <= 0:
        raise ValueError(f"task_weights must be {len(TASKS)} non-negative numbers, not all 0")
    mus = {f"{m}/{t}": calibrated_mu(MODELS[m].quality[k], MODELS[m].slope)
           for m in names for k, t in enumerate(TASKS)}
    tasks = rng.choice(len(TASKS), size=num_prompts, p=weights / weights.sum())
    out = []
    for k in tasks.tolist():
        draft = _draft(rng, TASKS[k])
        tokens = count_tokens(draft.text)
        decode, quality = _truth(draft, k, tokens, names, mus, rng)
        out.append(SyntheticPrompt(draft.text, TASKS[k], tokens, decode, quality))
    return out


# -- outputs -------------------------------------------------------------------------------
def training_data(prompts: Sequence[SyntheticPrompt]) -> TrainingData:
    """One training row per (prompt, model), for ``olproute.predict.train``."""
    index, models, tokens, quality = [], [], [], []
    for i, p in enumerate(prompts):
        for model, o in p.decode_tokens.items():
            index.append(i)
            models.append(model)
            tokens.append(o)
            quality.append(p.quality[model])
    return TrainingData(
        prompts=tuple(p.text for p in prompts), tasks=tuple(p.task for p in prompts),
        prompt_index=np.asarray(index, dtype=np.int64), models=tuple(models),
        output_tokens=np.asarray(tokens, dtype=np.float64),
        quality=np.asarray(quality, dtype=np.float64), source="synthetic")


TRAINING_COLUMNS = ("prompt", "model", "output_tokens", "quality", "task", "prompt_tokens")


def write_training_file(path: str | os.PathLike[str],
                        prompts: Sequence[SyntheticPrompt]) -> int:
    """Write one row per (prompt, model) as CSV, or JSONL when the name ends in ``.jsonl``;
    returns the number of rows."""
    p = Path(path)
    rows = [(s.text, model, o, s.quality[model], s.task, s.prompt_tokens)
            for s in prompts for model, o in s.decode_tokens.items()]
    with p.open("w", newline="") as f:
        if p.suffix == ".jsonl":
            for row in rows:
                f.write(json.dumps(dict(zip(TRAINING_COLUMNS, row, strict=True))) + "\n")
        else:
            writer = csv.writer(f)
            writer.writerow(TRAINING_COLUMNS)
            writer.writerows(rows)
    return len(rows)


def synthetic_requests(
    num_requests: int,
    arrival_s: npt.ArrayLike,
    models: Sequence[str],
    rng: np.random.Generator,
) -> list[Request]:
    """Simulator requests with generated prompts, per-model truth and BEAR TTFT targets.

    ``decode_tokens`` (and ``predicted_decode_tokens``, until a predictor overrides it) is
    the truth for the first model; ``decode_tokens_by_model`` / ``quality_by_model`` hold
    every model's. ``arrival_s`` (seconds, non-decreasing) has ``num_requests`` entries.
    """
    arrivals = np.asarray(arrival_s, dtype=np.float64)
    if arrivals.shape != (num_requests,):
        raise ValueError(f"arrival_s has shape {arrivals.shape}, expected ({num_requests},)")
    names = _check_models(models)
    prompts = generate_prompts(num_requests, names, rng)
    targets = bear_ttft_targets_s(
        np.array([p.prompt_tokens for p in prompts], dtype=np.int64), rng).tolist()
    first = names[0]
    return [
        Request(request_id=i, arrival_s=float(arrivals[i]), prompt_tokens=p.prompt_tokens,
                decode_tokens=p.decode_tokens[first],
                predicted_decode_tokens=p.decode_tokens[first], ttft_target_s=targets[i],
                text=p.text, task=p.task, decode_tokens_by_model=dict(p.decode_tokens),
                quality_by_model=dict(p.quality))
        for i, p in enumerate(prompts)
    ]
