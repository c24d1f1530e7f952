"""Long-context retrieval tasks in the manner of RULER, made from the corpus with no download
(``spherical-kv tasks``, docs/evaluate.md "Long-context tasks"): what each task plants in a
haystack of Jane Austen's text, the question asked after the context, the answer and its
scoring by exact match of the greedy output.

Every instance is a function of (task, context length, index, seed) alone: its generator is
seeded with those four, so a run of more instances or lengths holds the instances of a run of
fewer, and ``--resume`` can add them."""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field

import numpy as np

#: single-key needles sit at these depths (fractions of the context), instance i at DEPTHS[i % 5]
DEPTHS = (0.1, 0.25, 0.5, 0.75, 0.9)
#: characters that may follow a correct answer in the greedy output (an answer is not a prefix
#: of a longer number, name or list)
ENDS = set(" .!?;:'\")")

_ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "idle",
               "jolly", "keen", "lofty", "mellow", "noble", "odd", "pale", "quiet", "rusty",
               "silent", "tidy", "vivid", "wary", "young", "zealous")
_NOUNS = ("anchor", "barley", "candle", "dagger", "ember", "falcon", "garden", "harbour",
          "island", "jasmine", "kettle", "lantern", "meadow", "needle", "orchard", "pebble",
          "quarry", "ribbon", "saddle", "thistle", "umbrella", "violin", "willow", "yarrow")


@dataclass
class Instance:
    """One task instance. ``context``: the token ids every method compresses (``length`` of
    them); ``question``: the token ids fed through the compressed cache after it; ``answer``:
    the text the greedy output must start with; ``spans``: the planted items as token ranges
    [start, end) of ``context`` (what ``protect`` marks); ``start``: the token where the
    answer-bearing item starts; ``depth``: the share of the haystack's tokens before it
    (RULER's depth); ``max_new``: greedy tokens allowed."""
    task: str
    length: int
    index: int
    context: np.ndarray
    question: np.ndarray
    answer: str
    spans: list = field(default_factory=list)
    start: int = 0
    depth: float = 0.0
    max_new: int = 16


def normalise(text: str) -> str:
    """Whitespace runs as one space, none at the ends."""
    return " ".join(text.split())


def verdict(output: str, answer: str):
    """Whether the greedy ``output`` has answered: True (it starts with ``answer``, up to
    whitespace, and the answer ends there: end of text or a character of ``ENDS``), False
    (it can no longer), None (undecided: it is a proper prefix of the answer, or the answer
    with nothing after it yet)."""
    g, a = normalise(output), normalise(answer)
    if g.startswith(a):
        if len(g) == len(a):
            return None
        return g[len(a)] in ENDS
    return None if a.startswith(g) else False


def exact_match(output: str, answer: str) -> bool:
    """The task score of a finished greedy output: it starts with the answer and the answer
    ends there (``verdict``; the answer with nothing after it counts)."""
    return verdict(output, answer) is True or normalise(output) == normalise(answer)


def _rng(task: str, length: int, index: int, seed: int) -> np.random.Generator:
    # crc32 of the name, not its place in TASKS: adding a task changes no other's instances
    return np.random.default_rng([seed, zlib.crc32(task.encode()), length, index])


def _key(rng) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _keys(rng, n: int) -> list:
    out = []
    while len(out) < n:
        k = _key(rng)
        if k not in out:
            out.append(k)
    return out


def _number(rng) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _needle(key: str, number: str) -> str:
    return f"\nOne of the special magic numbers for {key} is: {number}.\n"


# A task: rng, index -> (planted [(depth, text)], question text, answer, depth of the answer's
# item). The question ends where the answer begins.

def _niah_single(rng, index):
    key, number, depth = _key(rng), _number(rng), DEPTHS[index % len(DEPTHS)]
    q = (f"\nWhat is the special magic number for {key} mentioned in the text above? "
         f"The special magic number for {key} mentioned in the text above is:")
    return [(depth, _needle(key, number))], q, number, depth


def _niah_multikey(rng, index):
    keys = _keys(rng, 4)                 # the first is asked for, three distract
    numbers = [_number(rng) for _ in keys]
    depths = rng.uniform(0.05, 0.95, len(keys))
    q = (f"\nWhat is the special magic number for {keys[0]} mentioned in the text above? "
         f"The special magic number for {keys[0]} mentioned in the text above is:")
    return ([(d, _needle(k, n)) for d, k, n in zip(depths, keys, numbers)], q, numbers[0],
            float(depths[0]))


def _niah_multivalue(rng, index):
    key = _key(rng)
    numbers = [_number(rng) for _ in range(4)]
    depths = np.sort(rng.uniform(0.05, 0.95, 4))
    q = (f"\nWhat are all the special magic numbers for {key} mentioned in the text above, in "
         f"order? The special magic numbers for {key} mentioned in the text above are:")
    return ([(d, _needle(key, n)) for d, n in zip(depths, numbers)], q, ", ".join(numbers),
            float(depths[0]))


def _variable(rng, taken) -> str:
    while True:
        name = "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5))
        if name not in taken:
            taken.add(name)
            return name


def _vartrack(rng, index):
    taken = set()
    planted, first = [], None
    value = str(int(rng.integers(10_000, 100_000)))
    chains = []
    for hops, v in ((4, value), (3, str(int(rng.integers(10_000, 100_000))))):   # asked, distractor
        names = [_variable(rng, taken) for _ in range(hops)]
        depths = np.sort(rng.uniform(0.05, 0.95, hops))
        lines = [f"\nVAR {names[0]} = {v}.\n"] + [f"\nVAR {b} = VAR {a}.\n"
                                                  for a, b in zip(names, names[1:])]
        planted += list(zip(depths, lines))
        chains.append(names)
        first = float(depths[0]) if first is None else first
    q = (f"\nFind all variables that are assigned the value {value} in the text above. "
         f"The variables assigned the value {value} are:")
    return planted, q, ", ".join(chains[0]), first


_WORDS = _NOUNS + ("apple", "bridge", "copper", "feather", "lemon", "mirror", "parcel",
                   "shadow", "tower", "velvet")


def _span(rng, index):
    key = rng.choice(_NOUNS)
    phrase = " ".join(rng.choice(_WORDS, 4, replace=False))
    depth = float(rng.uniform(0.02, 0.15))
    line = f"\nRemember this: the passphrase of the {key} is {phrase}.\n"
    q = f"\nWhat is the passphrase of the {key}? The passphrase of the {key} is"
    return [(depth, line)], q, phrase, depth


# Tools: (name, description, [(parameter, type, values)], request template). A request names
# every argument; the call lists them in the specification's order.
_TOOLS = (
    ("get_weather", "the current weather in a city",
     [("city", "string", ("Bath", "Derby", "Brighton", "London", "Portsmouth")),
      ("unit", "celsius or fahrenheit", ("celsius", "fahrenheit"))],
     "What is the weather in {city} now, in {unit}?"),
    ("book_table", "reserve a table at a restaurant",
     [("restaurant", "string", ("The Crown", "The Swan", "The Bell", "The Grapes")),
      ("people", "integer", (2, 3, 4, 6)), ("time", "HH:MM", ("18:30", "19:00", "20:15"))],
     "Please book a table at {restaurant} for {people} people at {time}."),
    ("send_email", "send an email",
     [("to", "address", ("jane@pemberley.org", "anne@kellynch.org", "emma@hartfield.org")),
      ("subject", "string", ("Dinner", "The ball", "A letter", "The visit"))],
     "Send an email to {to} with the subject {subject}."),
    ("convert_currency", "convert an amount of money",
     [("amount", "integer", (10, 25, 120, 300)),
      ("source", "currency code", ("GBP", "EUR", "USD")),
      ("target", "currency code", ("JPY", "CHF", "SEK"))],
     "How much is {amount} {source} in {target}?"),
    ("set_alarm", "set an alarm",
     [("time", "HH:MM", ("06:00", "07:30", "08:45")),
      ("label", "string", ("walk", "letters", "church", "tea"))],
     "Set an alarm for {time} labelled {label}."),
    ("find_train", "find trains between two towns",
     [("origin", "string", ("Bath", "Derby", "Lyme", "Winchester")),
      ("destination", "string", ("London", "Oxford", "Leeds", "York")),
      ("date", "YYYY-MM-DD", ("1811-10-30", "1813-01-28", "1815-12-23"))],
     "Find a train from {origin} to {destination} on {date}."),
    ("search_books", "search a library catalogue",
     [("author", "string", ("Burney", "Edgeworth", "Radcliffe", "Richardson")),
      ("year", "integer", (1778, 1794, 1801, 1814))],
     "Find books by {author} from {year}."),
)


def _tool_spec(name, description, params) -> str:
    ps = ", ".join(f'"{p}": "{t}"' for p, t, _ in params)
    return f'{{"name": "{name}", "description": "{description}", "parameters": {{{ps}}}}}'


def _toolcall(rng, index):
    chosen = [_TOOLS[i] for i in rng.permutation(len(_TOOLS))[:5]]
    name, _, params, request = chosen[int(rng.integers(len(chosen)))]
    args = {p: values[int(rng.integers(len(values)))] for p, _, values in params}
    block = ("Tools you can call, one per line. A call is written as name(parameter=value, ...), "
             "strings quoted, e.g. get_time(zone=\"UTC\", hours=24).\n"
             + "\n".join(_tool_spec(n, d, p) for n, d, p, _ in chosen) + "\n\n")
    call = f"{name}(" + ", ".join(f"{p}={v}" if isinstance(v, int) else f'{p}="{v}"'
                                  for p, v in args.items()) + ")"
    q = (f"\nUser: {request.format(**args)}\nAnswer with one call of a tool listed at the "
         f"start, its arguments in the listed order.\nAssistant:")
    return [(0.0, block)], q, call, 0.0


#: the tasks, by name: what each tests is in docs/evaluate.md "Long-context tasks"
TASKS = {"niah-single": _niah_single, "niah-multikey": _niah_multikey,
         "niah-multivalue": _niah_multivalue, "vartrack": _vartrack, "span": _span,
         "toolcall": _toolcall}


@functools.lru_cache(maxsize=1)
def _corpus_text() -> str:
    from spherical_kv_eval.data import load_austen
    return load_austen().joined()


def haystack(tok, rng, n: int, text: str | None = None) -> np.ndarray:
    """``n`` corpus tokens from a paragraph start drawn by ``rng`` (no special tokens)."""
    text = _corpus_text() if text is None else text
    chars = 8 * n + 200          # Austen runs about 4 characters a token
    start = int(rng.integers(0, max(1, len(text) - chars - 2000)))
    para = text.find("\n\n", start)
    start = para + 2 if 0 <= para < start + 2000 else start
    ids = tok(text[start:start + chars], add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise ValueError(f"the corpus gave {len(ids)} tokens from {start}, the haystack needs {n}")
    return np.asarray(ids[:n], dtype=np.int64)


def _ids(tok, text: str) -> np.ndarray:
    return np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def make_instance(task: str, length: int, index: int, tok, seed: int = 0,
                  text: str | None = None, bos: int | None = None) -> Instance:
    """Instance ``index`` of ``task`` at ``length`` context tokens: the task's planted items
    inserted, each at its depth (a fraction of the haystack, in tokens), into corpus text
    (``text``, default the Austen corpus) so that the context is ``length`` tokens long: an
    item at depth d follows the first round(d · n) of the n haystack tokens. ``bos``: a token
    id the context starts with (a model whose contexts each start with BOS)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    rng = _rng(task, length, index, seed)
    planted, question, answer, depth = TASKS[task](rng, index)
    planted = sorted(((float(d), _ids(tok, t)) for d, t in planted), key=lambda p: p[0])
    lead = [] if bos is None else [bos]
    fill = length - len(lead) - sum(len(ids) for _, ids in planted)
    if fill < 16:
        raise ValueError(f"{task} plants {length - fill} tokens: a context of {length} has no "
                         f"room for the haystack")
    hay = haystack(tok, rng, fill, text)
    parts, spans, at, pos = [np.asarray(lead, dtype=np.int64)], [], 0, len(lead)
    answer_start = None
    for d, ids in planted:
        cut = int(round(d * fill))
        parts += [hay[at:cut], ids]
        pos += cut - at
        spans.append((pos, pos + len(ids)))
        if answer_start is None and abs(d - depth) < 1e-12:
            answer_start = pos
        pos += len(ids)
        at = cut
    parts.append(hay[at:])
    context = np.concatenate(parts)
    q = _ids(tok, question)
    return Instance(task, length, index, context, q, answer, spans, start=answer_start,
                    depth=depth,
                    max_new=len(_ids(tok, " " + answer)) + 4)

