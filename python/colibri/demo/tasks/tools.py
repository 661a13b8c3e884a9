"""The demo tools (``get_weather``, ``get_time``, ``convert_currency``): their declarations, the
request phrasings (training's, held-out, with trailing words), the assistant's call message, and
whole tool episodes (request, expected call, tool result, the answer that uses it)."""

from __future__ import annotations

import json
import random
from typing import Any

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
