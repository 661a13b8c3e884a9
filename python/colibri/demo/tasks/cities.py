"""City names: the real cities of training and the held-out real ones of the evaluation, the
generator of city-like names, training's fixed pool of generated names, and the evaluation's
generated names (another stream, never in training)."""

from __future__ import annotations

import random

from .capitals import CAPITALS

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
