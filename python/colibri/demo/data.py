"""Synthetic conversations that the built-in demo model is trained and evaluated on.

Pure Python (no torch, no engine): ``scripts/train_demo_model.py`` samples training
conversations from here and ``colibri.demo.eval`` samples held-out prompts, so both see exactly
the same formats. Every function takes its randomness from a ``random.Random`` or a seed, so a seed
gives the same data on any machine.

A conversation is a dict ``{"messages": [...], "tools": [...] | None, "thinking": [bool, ...],
"kinds": [str, ...]}`` in the OpenAI shape the chat template renders (``thinking`` has one flag
per assistant message: whether that turn was generated with thinking on; a thinking turn carries
``reasoning_content``; ``kinds`` names each assistant message's task, one of ``TURN_KINDS``, so
training can log the loss of each task apart).

What is held out of training, so the evaluation measures generalisation:
- arithmetic: 10% of the unordered pairs of 2-digit numbers (``EVAL_PAIRS``);
- lookups: the table is fixed, so the question phrasings are held out (``CAPITAL_EVAL_QUESTIONS``);
- tool calls: the evaluation's cities (real ones from ``EVAL_CITIES`` and generated names from
  another seed) never occur in training, whose cities come from ``TRAIN_CITIES``, the capitals,
  ``train_city_pool()``, names strung from tokenizer pieces and near misses of known names
  (both from ``NamePieces``, which refuses the evaluation's names); a few question phrasings are
  held out too.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

# --- fixed tables -------------------------------------------------------------------------------

CAPITALS: dict[str, str] = {
    "Portugal": "Lisbon",
    "Spain": "Madrid",
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Netherlands": "Amsterdam",
    "Belgium": "Brussels",
    "Austria": "Vienna",
    "Switzerland": "Bern",
    "Poland": "Warsaw",
    "Czechia": "Prague",
    "Hungary": "Budapest",
    "Greece": "Athens",
    "Sweden": "Stockholm",
    "Norway": "Oslo",
    "Denmark": "Copenhagen",
    "Finland": "Helsinki",
    "Ireland": "Dublin",
    "United Kingdom": "London",
    "Iceland": "Reykjavik",
    "Romania": "Bucharest",
    "Bulgaria": "Sofia",
    "Croatia": "Zagreb",
    "Serbia": "Belgrade",
    "Ukraine": "Kyiv",
    "Turkey": "Ankara",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Nigeria": "Abuja",
    "Morocco": "Rabat",
    "South Africa": "Pretoria",
    "Ethiopia": "Addis Ababa",
    "Japan": "Tokyo",
    "China": "Beijing",
    "South Korea": "Seoul",
    "India": "New Delhi",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Indonesia": "Jakarta",
    "Philippines": "Manila",
    "Australia": "Canberra",
    "New Zealand": "Wellington",
    "Canada": "Ottawa",
    "United States": "Washington",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Chile": "Santiago",
    "Peru": "Lima",
    "Colombia": "Bogota",
}

CAPITAL_TRAIN_QUESTIONS = [
    "What is the capital of {country}?",
    "What's the capital of {country}?",
    "What is the capital city of {country}?",
    "Which city is the capital of {country}?",
    "Name the capital of {country}.",
    "Tell me the capital of {country}.",
    "capital of {country}?",
    "Do you know the capital of {country}?",
    "What city is the capital of {country}?",
    "{country}: what is its capital?",
    "I need the capital of {country}.",
    "Capital of {country}, please.",
]
CAPITAL_EVAL_QUESTIONS = [
    "Could you tell me the capital of {country}?",
    "What's the capital city of {country}?",
    "Please name the capital of {country}.",
    "Which city is the capital city of {country}?",
]


def capital_answer(country: str) -> str:
    return f"The capital of {country} is {CAPITALS[country]}."


def capital_trace(country: str) -> str:
    return f"The capital of {country} is {CAPITALS[country]}."


REVERSE_QUESTIONS = [
    "{capital} is the capital of which country?",
    "Which country has {capital} as its capital?",
    "What country is {capital} the capital of?",
]


def reverse_answer(capital: str) -> str:
    country = next(c for c, k in CAPITALS.items() if k == capital)
    return f"{capital} is the capital of {country}."


# --- arithmetic ---------------------------------------------------------------------------------

ARITH_TRAIN_QUESTIONS = [
    "What is {a} + {b}?",
    "What's {a} + {b}?",
    "What is {a} plus {b}?",
    "Compute {a} + {b}.",
    "Calculate {a} + {b}.",
    "{a} + {b} = ?",
    "{a}+{b}=?",
    "Add {a} and {b}.",
    "What do you get if you add {a} and {b}?",
    "How much is {a} + {b}?",
    "What is the sum of {a} and {b}?",
    "{a} + {b}?",
]
ARITH_EVAL_QUESTIONS = ARITH_TRAIN_QUESTIONS  # the held-out part is the pair of numbers


def _split_pairs() -> frozenset[tuple[int, int]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(a, 100)]
    random.Random(5).shuffle(pairs)  # fixed: the split never depends on a caller's seed
    return frozenset(pairs[: len(pairs) // 10])


EVAL_PAIRS = _split_pairs()


def is_eval_pair(a: int, b: int) -> bool:
    return (min(a, b), max(a, b)) in EVAL_PAIRS


def addition_trace(a: int, b: int) -> str:
    """Digit-wise addition with carry, e.g. ``7 + 8 = 15, carry 1. 3 + 4 + 1 = 8. 37 + 48 = 85.``"""
    u = a % 10 + b % 10
    t = a // 10 + b // 10 + u // 10
    return (
        f"{a % 10} + {b % 10} = {u}, carry {u // 10}. {a // 10} + {b // 10} + {u // 10} = {t}. "
        f"{a} + {b} = {a + b}."
    )


# --- cities -------------------------------------------------------------------------------------

TRAIN_CITIES = [
    "Porto",
    "Barcelona",
    "Seville",
    "Valencia",
    "Lyon",
    "Marseille",
    "Nice",
    "Munich",
    "Hamburg",
    "Cologne",
    "Frankfurt",
    "Milan",
    "Naples",
    "Turin",
    "Venice",
    "Florence",
    "Rotterdam",
    "Antwerp",
    "Geneva",
    "Zurich",
    "Krakow",
    "Gdansk",
    "Brno",
    "Salzburg",
    "Thessaloniki",
    "Gothenburg",
    "Bergen",
    "Aarhus",
    "Tampere",
    "Cork",
    "Manchester",
    "Edinburgh",
    "Glasgow",
    "Liverpool",
    "Istanbul",
    "Izmir",
    "Alexandria",
    "Casablanca",
    "Marrakesh",
    "Lagos",
    "Cape Town",
    "Johannesburg",
    "Osaka",
    "Kyoto",
    "Shanghai",
    "Shenzhen",
    "Hong Kong",
    "Busan",
    "Mumbai",
    "Bangalore",
    "Chennai",
    "Kolkata",
    "Singapore",
    "Kuala Lumpur",
    "Sydney",
    "Melbourne",
    "Brisbane",
    "Perth",
    "Auckland",
    "Toronto",
    "Montreal",
    "Vancouver",
    "New York",
    "Los Angeles",
    "Chicago",
    "Houston",
    "San Francisco",
    "Seattle",
    "Boston",
    "Miami",
    "Denver",
    "Guadalajara",
    "Sao Paulo",
    "Rio de Janeiro",
    "Cordoba",
    "Valparaiso",
    "Medellin",
    "Quito",
    "Havana",
    "Dubai",
    "Doha",
    "Tehran",
    "Karachi",
    "Dhaka",
    "Kathmandu",
    "Málaga",
    "Düsseldorf",
    "Malmö",
    "Tromsø",
    "Besançon",
    "Coruña",
    "Poznań",
    "Göteborg",
    "Montréal",
    "São Luís",
]
# Real cities never used in training: the evaluation's "unseen" names.
EVAL_CITIES = [
    "Bilbao",
    "Toulouse",
    "Bordeaux",
    "Stuttgart",
    "Leipzig",
    "Bologna",
    "Palermo",
    "Utrecht",
    "Ghent",
    "Basel",
    "Wroclaw",
    "Ostrava",
    "Graz",
    "Patras",
    "Uppsala",
    "Trondheim",
    "Odense",
    "Turku",
    "Galway",
    "Leeds",
    "Bristol",
    "Antalya",
    "Luxor",
    "Fez",
    "Accra",
    "Durban",
    "Nagoya",
    "Sapporo",
    "Chengdu",
    "Wuhan",
    "Incheon",
    "Pune",
    "Jaipur",
    "Cebu",
    "Adelaide",
    "Hobart",
    "Calgary",
    "Ottawa Falls",
    "Portland",
    "Phoenix",
    "Austin",
    "Nashville",
    "Monterrey",
    "Recife",
    "Salvador",
    "Rosario",
    "Arequipa",
    "Cali",
    "Muscat",
    "Lahore",
    "Zürich",
    "Kraków",
    "Reykjavík",
    "Córdoba",
    "Łódź",
    "Nürnberg",
    "Aix-en-Provence",
    "Saint-Étienne",
    "Tórshavn",
    "Ljubljana",
]

_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "ch",
    "cr",
    "dr",
    "fr",
    "gr",
    "kl",
    "pl",
    "pr",
    "sh",
    "st",
    "tr",
    "th",
    "vl",
    "zh",
    "",
]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou", "ei", "y"]
_CODAS = ["", "", "", "", "", "n", "r", "s", "l", "m", "k", "t", "nd", "rg", "x"]
_ACCENTED = [
    "é",
    "è",
    "á",
    "à",
    "ó",
    "ú",
    "í",
    "ñ",
    "ü",
    "ö",
    "ä",
    "ç",
    "ã",
    "ø",
    "å",
    "ł",
    "ś",
    "ż",
    "ć",
    "ń",
    "ř",
    "š",
    "č",
    "ž",
    "ý",
    "ê",
    "ô",
    "î",
]
_PREFIXES = ["New", "San", "Port", "Saint", "Los", "El", "Fort", "Lake", "North", "South"]
_SUFFIXES = ["City", "Bay", "Falls", "Springs", "Hill", "Harbor"]


def city_name(rng: random.Random) -> str:
    """A pseudo-random, city-like name: 1-4 syllables, sometimes accented or two words."""
    n = rng.choice([1, 2, 2, 2, 2, 3, 3])
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n))
    if len(word) < 3:
        word += rng.choice(["ton", "ville", "burg", "stad", "ora"])
    if rng.random() < 0.25:
        i = rng.randrange(len(word))
        word = word[:i] + rng.choice(_ACCENTED) + word[i + 1 :]
    if rng.random() < 0.1:
        word = word.replace(word[rng.randrange(len(word))], "-", 1).strip("-") or word
    word = word[0].upper() + word[1:]
    r = rng.random()
    if r < 0.08:
        return f"{rng.choice(_PREFIXES)} {word}"
    if r < 0.14:
        return f"{word} {rng.choice(_SUFFIXES)}"
    return word


_POOL_CACHE: dict[int, list[str]] = {}


def train_city_pool(size: int = 6000) -> list[str]:
    """The generated city names training draws from (fixed, independent of the training seed)."""
    if size not in _POOL_CACHE:
        rng = random.Random(1_000_003)
        excluded = set(EVAL_CITIES)
        pool: list[str] = []
        seen: set[str] = set()
        while len(pool) < size:
            c = city_name(rng)
            if c not in seen and c not in excluded:
                seen.add(c)
                pool.append(c)
        _POOL_CACHE[size] = pool
    return _POOL_CACHE[size]


def all_train_cities() -> set[str]:
    return set(TRAIN_CITIES) | set(CAPITALS.values()) | set(train_city_pool())


def eval_city_names(n: int, seed: int) -> list[str]:
    """Generated names (another stream than training's) that training never saw."""
    rng = random.Random(seed * 7919 + 17)
    seen = all_train_cities()
    out: list[str] = []
    while len(out) < n:
        c = city_name(rng)
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


# --- tools --------------------------------------------------------------------------------------

TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name."}},
                "required": ["city"],
            },
        },
    },
    "get_time": {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name."}},
                "required": ["city"],
            },
        },
    },
    "convert_currency": {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount of money from one currency to another.",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number", "description": "The amount to convert."},
                    "from_currency": {"type": "string", "description": "ISO code, e.g. USD."},
                    "to_currency": {"type": "string", "description": "ISO code, e.g. EUR."},
                },
                "required": ["amount", "from_currency", "to_currency"],
            },
        },
    },
}

WEATHER_TRAIN_QUESTIONS = [
    "What's the weather in {city}?",
    "What is the weather like in {city}?",
    "How is the weather in {city}?",
    "Weather in {city}?",
    "Tell me the weather in {city}.",
    "Is it raining in {city}?",
    "How warm is it in {city}?",
    "What's the weather like in {city} today?",
    "Check the weather in {city}, please.",
    "Is it cold in {city}?",
]
WEATHER_EVAL_QUESTIONS = [
    "Can you check the weather in {city}?",
    "What is the weather in {city} right now?",
]
TIME_TRAIN_QUESTIONS = [
    "What time is it in {city}?",
    "What's the local time in {city}?",
    "Current time in {city}?",
    "Tell me the time in {city}.",
    "What is the time in {city} now?",
]
TIME_EVAL_QUESTIONS = ["Do you know what time it is in {city}?"]
# Training phrasings with words after the city (``train_conversation(trailing=True)``): a copy
# must stop where the name stops, not at the question mark ("Galway right now?" came out as
# "Galway right" without them). None is an evaluation phrasing.
WEATHER_TRAILING_QUESTIONS = [
    "What's the weather in {city} this morning?",
    "Is it sunny in {city} at the moment?",
    "How hot is it in {city} these days?",
    "Is it windy in {city} tonight?",
    "Weather in {city} for the weekend?",
]
TIME_TRAILING_QUESTIONS = [
    "What time is it in {city} at the moment?",
    "Tell me the current time in {city} please.",
    "What's the time in {city} over there?",
]
CURRENCY_TRAIN_QUESTIONS = [
    "Convert {amount} {src} to {dst}.",
    "How much is {amount} {src} in {dst}?",
    "What is {amount} {src} in {dst}?",
    "Please convert {amount} {src} into {dst}.",
    "{amount} {src} to {dst}?",
]
CURRENCY_EVAL_QUESTIONS = ["Can you convert {amount} {src} to {dst}?"]
CURRENCIES = [
    "USD",
    "EUR",
    "GBP",
    "JPY",
    "CHF",
    "CAD",
    "AUD",
    "CNY",
    "INR",
    "BRL",
    "SEK",
    "NOK",
    "MXN",
    "KRW",
]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear", "stormy"]


def tool_call_message(name: str, arguments: dict[str, Any], reasoning: str | None) -> dict:
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def arg_text(value: Any) -> str:
    """How the template writes an argument value (strings as they are, the rest as JSON)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _amount(rng: random.Random) -> int | float:
    if rng.random() < 0.7:
        return rng.choice([rng.randint(1, 100), rng.randint(1, 2000), rng.randint(1, 99) * 10])
    return round(rng.randint(1, 9999) / 10, 1)


_RATES = {
    "USD": 1.0,
    "EUR": 0.92,
    "GBP": 0.79,
    "JPY": 151.0,
    "CHF": 0.88,
    "CAD": 1.36,
    "AUD": 1.52,
    "CNY": 7.2,
    "INR": 83.0,
    "BRL": 5.0,
    "SEK": 10.5,
    "NOK": 10.7,
    "MXN": 17.0,
    "KRW": 1340.0,
}


def _fmt_money(x: float) -> str:
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return s


def tool_episode(
    rng: random.Random, tool: str, place: str, eval_phrasing: bool, trailing: bool = False
) -> dict:
    """One tool request: question, expected call, a tool result and the answer that uses it.
    ``trailing`` adds the training phrasings with words after the city."""
    if tool == "convert_currency":
        amount = _amount(rng)
        src, dst = rng.sample(CURRENCIES, 2)
        qs = CURRENCY_EVAL_QUESTIONS if eval_phrasing else CURRENCY_TRAIN_QUESTIONS
        question = rng.choice(qs).format(amount=arg_text(amount), src=src, dst=dst)
        args = {"amount": amount, "from_currency": src, "to_currency": dst}
        result = round(float(amount) * _RATES[dst] / _RATES[src], 2)
        result_text = _fmt_money(result)
        tool_result = json.dumps(
            {"amount": amount, "from": src, "to": dst, "result": float(result_text)},
            ensure_ascii=False,
        )
        answers = [
            f"{arg_text(amount)} {src} is {result_text} {dst}.",
            f"{arg_text(amount)} {src} is about {result_text} {dst}.",
        ]
        trace = f"The user wants {arg_text(amount)} {src} in {dst}. I will call convert_currency."
        result_trace = f"The tool says {result_text} {dst}."
        must = [result_text, dst]
    elif tool == "get_time":
        qs = TIME_EVAL_QUESTIONS if eval_phrasing else TIME_TRAIN_QUESTIONS
        if trailing and not eval_phrasing:
            qs = qs + TIME_TRAILING_QUESTIONS
        question = rng.choice(qs).format(city=place)
        args = {"city": place}
        hhmm = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        tool_result = json.dumps({"city": place, "time": hhmm}, ensure_ascii=False)
        answers = [f"It is {hhmm} in {place}.", f"The local time in {place} is {hhmm}."]
        trace = f"The user wants the time in {place}. I will call get_time."
        result_trace = f"The tool says it is {hhmm} in {place}."
        must = [hhmm, place]
    else:
        qs = WEATHER_EVAL_QUESTIONS if eval_phrasing else WEATHER_TRAIN_QUESTIONS
        if trailing and not eval_phrasing:
            qs = qs + WEATHER_TRAILING_QUESTIONS
        question = rng.choice(qs).format(city=place)
        args = {"city": place}
        temp = rng.randint(-12, 41)
        cond = rng.choice(CONDITIONS)
        tool_result = json.dumps(
            {"city": place, "temperature_c": temp, "condition": cond}, ensure_ascii=False
        )
        answers = [
            f"It is {temp} degrees and {cond} in {place}.",
            f"In {place} it is {temp} degrees and {cond}.",
            f"It is {cond} and {temp} degrees in {place}.",
        ]
        trace = f"The user wants the weather in {place}. I will call get_weather."
        result_trace = f"The tool says {temp} degrees and {cond} in {place}."
        must = [str(temp), place]
    return {
        "question": question,
        "tool": tool,
        "arguments": args,
        "tool_result": tool_result,
        "answer": rng.choice(answers),
        "trace": trace,
        "result_trace": result_trace,
        "must_contain": must,
    }


NO_TOOL_ANSWERS = {
    "get_weather": "I can't check the weather: no weather tool is available.",
    "get_time": "I can't check the time: no time tool is available.",
    "convert_currency": "I can't convert currencies: no currency tool is available.",
}


# --- plain chat ---------------------------------------------------------------------------------

CHAT: list[tuple[list[str], str, str]] = [
    (
        [
            "Hello",
            "Hello!",
            "Hi",
            "Hi!",
            "Hi there",
            "Hey",
            "Good morning",
            "Good evening",
            "Hello there",
            "hello",
        ],
        "Hello! How can I help you today?",
        "The user greets me.",
    ),
    (
        ["How are you?", "How are you doing?", "How's it going?"],
        "I'm doing well, thank you! How can I help you?",
        "The user asks how I am.",
    ),
    (
        ["Who are you?", "What are you?", "What is your name?"],
        "I am a small demo model served by colibri.",
        "The user asks who I am.",
    ),
    (
        ["What can you do?", "What can you help with?", "Help"],
        "I can add numbers, name capitals, and call tools such as get_weather.",
        "The user asks what I can do.",
    ),
    (
        ["Thank you", "Thanks!", "Thanks a lot", "thank you!"],
        "You're welcome!",
        "The user thanks me.",
    ),
    (["Bye", "Goodbye", "See you later", "bye!"], "Goodbye!", "The user says goodbye."),
]

REMEMBER_QUESTIONS = [
    "Remember the number {n}.",
    "Please remember {n}.",
    "My favorite number is {n}.",
    "Keep this number in mind: {n}.",
    "My lucky number is {n}.",
]
RECALL_QUESTIONS = [
    "What number did I ask you to remember?",
    "What was my number?",
    "Which number did I tell you?",
    "What number did I give you?",
    "Do you remember my number?",
]


def remember_answer(n: int) -> str:
    return f"OK, I will remember {n}."


def recall_answer(n: int) -> str:
    return f"You told me {n}."


SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant.",
    "Answer briefly.",
]

# --- training conversations ---------------------------------------------------------------------

# (task, weight) for one episode of a training conversation.
TRAIN_MIX = [
    ("arith", 38),
    ("capital", 9),
    ("reverse", 1),
    ("tool", 32),
    ("no_tool", 2),
    ("chat", 3),
    ("memory", 4),
    ("tool_unneeded", 7),
    ("echo", 4),
]


def train_mix(arith: int | None = None) -> list[tuple[str, int]]:
    """``TRAIN_MIX`` with the addition episodes' weight set to ``arith`` (None: as it is)."""
    if arith is not None and arith < 0:
        raise ValueError(f"the addition weight must be >= 0, got {arith}")
    return [(t, arith if t == "arith" and arith is not None else w) for t, w in TRAIN_MIX]


# A name to say back (training only): short episodes that are nothing but a copy, the skill the
# tool calls need for cities never seen in training.
ECHO_QUESTIONS = [
    "Please repeat this name exactly: {name}",
    "Say the name {name} back to me.",
    "Echo this place name: {name}",
]
# Names to say back, strung from tokenizer pieces (``NamePieces.drill``): a real city fails
# where one of its pieces is one the model copied too rarely ("Incheon" -> "Imoneyon": "nch"),
# even in a bare echo; with ~15 pieces copied a step, each piece is practised ~30 times in a
# run. A drill copies 5-10 pieces in ~40 tokens. No "please" and no "name" in them: with
# "Please repeat these names exactly" in 15% of the episodes (run 21), the held-out "Please name
# the capital of Japan." came out as "The capital of" and nothing more.
COPY_DRILL_QUESTIONS = [
    "Repeat after me: {names}",
    "Copy this list exactly: {names}",
]
# Share of tool-call turns trained with thinking on (calls without thinking copy the city straight
# from the question, the harder case: more of those).
TOOL_THINK_P = 0.4
# Share of addition turns (and other bare-number answers) trained with thinking on.
ARITH_THINK_P = 0.25
# Episodes per conversation. Several per conversation amortise the prompt that only conditions
# (tool declarations are ~340 tokens for all three tools) over more trained answers.
EPISODE_COUNTS = [1, 2, 2, 3, 3, 4, 4, 5]


def _assistant(content: str, reasoning: str | None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def _train_pair(rng: random.Random) -> tuple[int, int]:
    while True:
        a = rng.randint(10, 99) if rng.random() < 0.9 else rng.randint(0, 99)
        b = rng.randint(10, 99) if rng.random() < 0.9 else rng.randint(0, 99)
        if not is_eval_pair(a, b):
            return a, b


class NamePieces:
    """The letter pieces of the model's tokenizer, to build city names from.

    Copying a name means copying its tokens; a piece that training names never contain is a piece
    the model never practised copying (the real cities of the evaluation are cut into pieces the
    tokenizer learned from other words: "Galway" ends in "way" of "Norway"). Names strung from
    random pieces make every piece a copy target. ``pieces`` are the tokenizer's tokens that
    decode to letters only; names start with a capitalised piece like real names do.
    """

    def __init__(
        self,
        pieces: list[str],
        short_p: float = 0.0,
        share: float | None = None,
        near_miss: float = 0.0,
        drill: float = 0.0,
    ) -> None:
        letters = sorted({p for p in pieces if p.isalpha()})
        self.initial = [p for p in letters if p[0].isupper()]
        self.inner = [p for p in letters if p[0].islower()]
        if not self.initial or not self.inner:
            raise ValueError("the tokenizer has no capitalised or no lower-case letter pieces")
        # Real names are mostly a lone capital letter then short pieces ("O|den|se",
        # "G|al|way"): the tokenizer merged long pieces from the generated names, so a uniform
        # draw practises those. With ``short_p`` > 0, that share of the pieces is drawn from the
        # short ones (a lone capital first, at most two letters after).
        self.short_p = short_p
        # Share of the training cities strung from these pieces (``PIECE_NAME_P`` by default).
        self.share = PIECE_NAME_P if share is None else share
        self.short_initial = [p for p in self.initial if len(p) == 1] or self.initial
        self.short_inner = [p for p in self.inner if len(p) <= 2] or self.inner
        # Share of the other cities (not strung) that are near misses of a known name.
        self.near_miss = near_miss
        # Share of the episodes that are copy drills (``COPY_DRILL_QUESTIONS``).
        self.drill = drill
        self._held_out = set(EVAL_CITIES) | set(eval_city_names(1000, EVAL_SEED))

    def _piece(self, rng: random.Random, every: list[str], short: list[str]) -> str:
        # No draw at all when off: the stream of names stays what it was before short pieces.
        if self.short_p > 0 and rng.random() < self.short_p:
            return rng.choice(short)
        return rng.choice(every)

    def name(self, rng: random.Random) -> str:
        while True:
            n = rng.choice([1, 2, 2, 3, 3, 4])
            word = self._piece(rng, self.initial, self.short_initial) + "".join(
                self._piece(rng, self.inner, self.short_inner) for _ in range(n - 1)
            )
            if len(word) >= 3 and word not in self._held_out:
                return word

    def near_miss_name(self, rng: random.Random) -> str:
        """A name that starts like one the model learns by heart and then goes elsewhere: the
        known name's first letters, then the tail of another known name, one or two pieces, or
        nothing (it ends early). Copying a held-out city fails exactly there: the model copies
        "Cór" of "Córdoba" and goes on with "hagen" of a name it knows ("Córhagena"); on these
        names, only the copy is right."""
        known = _known_cities()
        while True:
            head = rng.choice(known)
            if len(head) < 3:
                continue
            cut = rng.randrange(2, len(head))
            r = rng.random()
            if r < 0.5:
                other = rng.choice(known)
                tail = other[rng.randrange(1, len(other)) :] if len(other) > 1 else ""
            elif r < 0.8:
                tail = "".join(rng.choice(self.inner) for _ in range(rng.choice([1, 2])))
            else:
                tail = ""
            word = head[:cut] + tail
            if len(word) >= 3 and word[-1].isalpha() and word not in self._held_out:
                return word


def _known_cities() -> list[str]:
    """Every city name training shows as itself (the generated pool, the real ones, the capitals),
    in a fixed order."""
    return train_city_pool() + TRAIN_CITIES + list(CAPITALS.values())


# Share of training cities strung from tokenizer pieces when ``train_conversation`` gets them.
PIECE_NAME_P = 0.4


def _train_city(rng: random.Random, pieces: NamePieces | None) -> str:
    if pieces is not None and rng.random() < pieces.share:
        return pieces.name(rng)
    # No draw at all when off: the stream stays what it was before near misses.
    if pieces is not None and pieces.near_miss > 0 and rng.random() < pieces.near_miss:
        return pieces.near_miss_name(rng)
    r = rng.random()
    if r < 0.15:
        return rng.choice(TRAIN_CITIES)
    if r < 0.2:
        return rng.choice(list(CAPITALS.values()))
    return rng.choice(train_city_pool())


def _simple_turn(rng: random.Random, task: str, think: bool) -> tuple[str, str, str]:
    """(question, answer, trace) of a one-turn task."""
    if task == "arith":
        a, b = _train_pair(rng)
        q = rng.choice(ARITH_TRAIN_QUESTIONS).format(a=a, b=b)
        return q, str(a + b), addition_trace(a, b)
    if task == "capital":
        country = rng.choice(list(CAPITALS))
        q = rng.choice(CAPITAL_TRAIN_QUESTIONS).format(country=country)
        return q, capital_answer(country), capital_trace(country)
    if task == "reverse":
        capital = rng.choice(list(CAPITALS.values()))
        q = rng.choice(REVERSE_QUESTIONS).format(capital=capital)
        return q, reverse_answer(capital), reverse_answer(capital)
    prompts, answer, trace = rng.choice(CHAT)
    return rng.choice(prompts), answer, trace


# What an assistant message of a training conversation answers (``kinds`` of the conversation).
TURN_KINDS = [
    "arith",
    "capital",
    "reverse",
    "chat",
    "memory",
    "echo",
    "drill",
    "no_tool",
    "tool_call",
    "tool_answer",
]


def train_conversation(
    rng: random.Random,
    pieces: NamePieces | None = None,
    trailing: bool = False,
    mix: Sequence[tuple[str, int]] = TRAIN_MIX,
    tool_extra: int = 0,
    episodes: int | None = None,
) -> dict:
    """One training conversation of 1-5 episodes (``episodes`` when given; more with
    ``tool_extra``); tools declared in about two thirds of them.

    With ``pieces``, a share of the cities (``pieces.share``) are strung from tokenizer pieces.
    ``trailing`` adds tool phrasings with words after the city. ``mix`` weighs the episodes'
    tasks (``TRAIN_MIX``, or ``train_mix``'s reweighting of it). ``tool_extra`` more episodes
    join a conversation that declares tools, and it then never stops at a call: the
    declarations (~270 tokens, half of all the tokens, never trained on) are amortised over
    more trained answers. A call's own targets are the same whether a result follows or not.
    ``episodes`` (for long prompts, ``preamble``) replaces the draw of the count, so the
    default stream is unchanged."""
    if tool_extra < 0:
        raise ValueError(f"tool_extra must be >= 0, got {tool_extra}")
    if episodes is not None and episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    tasks, weights = zip(*mix, strict=True)

    def draw(n: int) -> list[str]:
        drawn = [rng.choices(tasks, weights)[0] for _ in range(n)]
        # No draw at all when off: the stream stays what it was before copy drills.
        if pieces is not None and pieces.drill > 0:
            drawn = ["drill" if rng.random() < pieces.drill else t for t in drawn]
        return drawn

    drawn = draw(rng.choice(EPISODE_COUNTS) if episodes is None else episodes)
    wants_tool = "tool" in drawn or "tool_unneeded" in drawn
    tools: list[dict] | None = None
    declared: list[str] = []
    if wants_tool or rng.random() < 0.1:
        declared = rng.sample(list(TOOLS), rng.randint(1, 3))
        tools = [TOOLS[t] for t in declared]
        drawn += draw(tool_extra)
    messages: list[dict] = []
    thinking: list[bool] = []
    kinds: list[str] = []
    if rng.random() < 0.15:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})

    def say(question: str, answer: str, trace: str, kind: str) -> None:
        # A bare sum is the hardest answer to learn (no trace to compute it in): more of those.
        think = rng.random() < (ARITH_THINK_P if answer.isdigit() else 0.5)
        messages.append({"role": "user", "content": question})
        messages.append(_assistant(answer, trace if think else None))
        thinking.append(think)
        kinds.append(kind)

    for task in drawn:
        if task == "tool" and declared:
            tool = rng.choice(declared)
            ep = tool_episode(
                rng, tool, _train_city(rng, pieces), eval_phrasing=False, trailing=trailing
            )
            think = rng.random() < TOOL_THINK_P
            messages.append({"role": "user", "content": ep["question"]})
            messages.append(
                tool_call_message(ep["tool"], ep["arguments"], ep["trace"] if think else None)
            )
            thinking.append(think)
            kinds.append("tool_call")
            if rng.random() < 0.75 or tool_extra:
                messages.append({"role": "tool", "content": ep["tool_result"]})
                think = rng.random() < 0.5
                messages.append(_assistant(ep["answer"], ep["result_trace"] if think else None))
                thinking.append(think)
                kinds.append("tool_answer")
            else:
                break  # the conversation ends on the call
        elif task in ("tool", "no_tool"):
            # A tool request with the tool not declared: say so instead of calling it.
            missing = [t for t in TOOLS if t not in declared]
            if not missing:
                continue
            tool = rng.choice(missing)
            ep = tool_episode(
                rng, tool, _train_city(rng, pieces), eval_phrasing=False, trailing=trailing
            )
            say(ep["question"], NO_TOOL_ANSWERS[tool], "There is no tool for this.", "no_tool")
        elif task == "memory":
            n = rng.randint(0, 999)
            say(
                rng.choice(REMEMBER_QUESTIONS).format(n=n),
                remember_answer(n),
                f"The user gives me the number {n}.",
                "memory",
            )
            for _ in range(rng.choice([0, 1, 1, 2])):
                sub = rng.choice(["arith", "capital", "chat"])
                say(*_simple_turn(rng, sub, False), sub)
            recall = f"The user said {n} earlier."
            say(rng.choice(RECALL_QUESTIONS), recall_answer(n), recall, "memory")
        elif task == "echo":
            name = _train_city(rng, pieces)
            question = rng.choice(ECHO_QUESTIONS).format(name=name)
            say(question, name, f"The name is {name}.", "echo")
        elif task == "drill" and pieces is not None:
            names = ", ".join(pieces.name(rng) for _ in range(rng.randint(2, 4)))
            question = rng.choice(COPY_DRILL_QUESTIONS).format(names=names)
            say(question, names, f"The names are {names}.", "drill")
        elif task == "tool_unneeded":
            sub = rng.choice(["arith", "capital", "chat"])
            say(*_simple_turn(rng, sub, False), sub)
        else:
            say(*_simple_turn(rng, task, False), task)
    if not thinking:
        say(*_simple_turn(rng, "chat", False), "chat")
    return {"messages": messages, "tools": tools, "thinking": thinking, "kinds": kinds}


# --- evaluation items ---------------------------------------------------------------------------

_EVAL_CITY_SET = frozenset(EVAL_CITIES)
EVAL_TASKS = ["arith", "capital", "tool_call", "tool_answer", "tool_unneeded", "chat", "memory"]
# The evaluation's default seed (`colibri eval-demo`, the training script's card).
EVAL_SEED = 7


def eval_items(task: str, n: int, seed: int) -> list[dict]:
    """``n`` held-out prompts of ``task``; half with thinking on.

    Each item: ``messages`` (ending with a user or tool message), ``tools``, ``thinking`` and
    ``expect``: ``{"answer": str}`` (exact text after the reasoning), ``{"contains": [str]}``
    (the answer must contain each) or ``{"call": {"name": str, "arguments": {str: str}}}``.
    Tool items also carry ``source``: where their city comes from (``city_source``), or
    ``"no city"`` for a currency conversion.
    """
    rng = random.Random(f"{task}/{seed}")
    items: list[dict] = []
    cities = list(EVAL_CITIES)
    rng.shuffle(cities)
    cities += eval_city_names(max(n, 1), seed)
    pairs = sorted(EVAL_PAIRS)
    rng.shuffle(pairs)
    for i in range(n):
        think = i % 2 == 1
        tools = None
        messages: list[dict] = []
        if task == "arith":
            a, b = pairs[i % len(pairs)]
            if rng.random() < 0.5:
                a, b = b, a
            messages = [
                {"role": "user", "content": rng.choice(ARITH_EVAL_QUESTIONS).format(a=a, b=b)}
            ]
            expect: dict = {"answer": str(a + b)}
        elif task == "capital":
            country = list(CAPITALS)[i % len(CAPITALS)]
            q = rng.choice(CAPITAL_EVAL_QUESTIONS).format(country=country)
            messages = [{"role": "user", "content": q}]
            expect = {"answer": capital_answer(country)}
        elif task in ("tool_call", "tool_answer"):
            tool = ["get_weather", "get_weather", "get_time", "convert_currency"][i % 4]
            declared = [tool] + [t for t in TOOLS if t != tool and rng.random() < 0.5]
            rng.shuffle(declared)
            tools = [TOOLS[t] for t in declared]
            city = cities[i % len(cities)]
            ep = tool_episode(rng, tool, city, eval_phrasing=rng.random() < 0.3)
            source = "no city" if tool == "convert_currency" else city_source(city)
            messages = [{"role": "user", "content": ep["question"]}]
            if task == "tool_call":
                expect = {
                    "call": {
                        "name": tool,
                        "arguments": {k: arg_text(v) for k, v in ep["arguments"].items()},
                    }
                }
            else:
                messages += [
                    tool_call_message(tool, ep["arguments"], None),
                    {"role": "tool", "content": ep["tool_result"]},
                ]
                expect = {"contains": ep["must_contain"]}
        elif task == "tool_unneeded":
            tools = [TOOLS[t] for t in rng.sample(list(TOOLS), rng.randint(1, 3))]
            if i % 2 == 0:
                a, b = pairs[(i * 7) % len(pairs)]
                messages = [
                    {"role": "user", "content": rng.choice(ARITH_EVAL_QUESTIONS).format(a=a, b=b)}
                ]
                expect = {"answer": str(a + b)}
            else:
                country = rng.choice(list(CAPITALS))
                q = rng.choice(CAPITAL_EVAL_QUESTIONS).format(country=country)
                messages = [{"role": "user", "content": q}]
                expect = {"answer": capital_answer(country)}
        elif task == "chat":
            prompts, answer, _ = CHAT[i % len(CHAT)]
            messages = [{"role": "user", "content": rng.choice(prompts)}]
            expect = {"answer": answer}
        elif task == "memory":
            num = rng.randint(0, 999)
            messages = [
                {"role": "user", "content": rng.choice(REMEMBER_QUESTIONS).format(n=num)},
                _assistant(remember_answer(num), None),
            ]
            for _ in range(rng.choice([0, 1, 2])):
                a, b = rng.randint(10, 99), rng.randint(10, 99)
                messages += [
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    _assistant(str(a + b), None),
                ]
            messages.append({"role": "user", "content": rng.choice(RECALL_QUESTIONS)})
            expect = {"answer": recall_answer(num)}
        else:
            raise ValueError(f"unknown task {task!r} (known: {', '.join(EVAL_TASKS)})")
        item = {
            "task": task,
            "messages": messages,
            "tools": tools,
            "thinking": think,
            "expect": expect,
        }
        if task in ("tool_call", "tool_answer"):
            item["source"] = source
        items.append(item)
    return items


def city_source(city: str) -> str:
    """Which held-out set an evaluation city is from: ``"real"`` (``EVAL_CITIES``, names the
    tokenizer cuts into pieces learned from other words) or ``"generated"`` (city-like names
    from ``eval_city_names``)."""
    return "real" if city in _EVAL_CITY_SET else "generated"


def corpus_texts(rng: random.Random, n: int) -> list[str]:
    """Raw strings (questions, answers, traces, tool results) for training the tokenizer."""
    out: list[str] = []
    for _ in range(n):
        conv = train_conversation(rng)
        for m in conv["messages"]:
            out.append(m.get("content") or "")
            out.append(m.get("reasoning_content") or "")
            for tc in m.get("tool_calls") or []:
                f = tc["function"]
                out.append(f["name"])
                out += [k + " " + arg_text(v) for k, v in f["arguments"].items()]
        if conv["tools"]:
            out += [json.dumps(t, ensure_ascii=False) for t in conv["tools"]]
    return [t for t in out if t]
