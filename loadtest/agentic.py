"""The `agentic` workload: an agent loop that answers with tool calls, generated, not read.

A system prompt defines six tools and one call format, a line of JSON

    {"tool": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}

and worked examples follow it as chat turns, a call of each tool (HEAD): a 135M model
copies a format from examples more than from a rule, and given a transcript inside the
system prompt instead it copied the transcript, `User:` lines and all. Each task is a
conversation of two or three user turns: a ticket's request, then one or two tool results
(sent as user turns, `Tool result: {...} Next: ...`, since the chat template has no tool
role), each asking for the next call. A stream resends HEAD and the history with the answers
it received (walks.ConversationWalk), as an agent framework does.

Tasks come in four kinds (trip, order, meeting, refund), whose values (cities, dates,
names, ids, amounts) a random generator seeded by the task's index draws: task i is the
same in every process, and each task carries a ticket number that no other task has, so
two tasks never send the same prompt. The calls repeat their format, not their values:
what a store of earlier answers could propose is the format. `TASKS` is indexable up to
2**63 - 1, so a run never runs out of tasks and need not repeat one (bench.py gives each
mode its own part of them: walks.PART_SIZE).

Pure: no I/O, no model, no server.
"""

from __future__ import annotations

import datetime
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

NUM_TASKS = 2**63 - 1  # as many as len() allows
CALL_FORMAT = '{"tool": "<name>", "arguments": {...}}'


@dataclass(frozen=True)
class Task:
    """One conversation: the user turns, and the call each turn asks for (the reference
    answer; the walk resends the model's own answers, whatever they were)."""

    kind: str
    turns: list[str]  # user messages, in order
    calls: list[dict]  # {"tool", "arguments"} for each turn

    def __post_init__(self) -> None:
        if len(self.turns) != len(self.calls):
            raise ValueError("a call for each turn")


# The tools: name -> (what it does, its arguments). Written into the system prompt.
TOOLS: dict[str, tuple[str, str]] = {
    "get_weather": ("current weather in a city", '"city", "unit" ("celsius" or "fahrenheit")'),
    "search_flights": ("flights on a date", '"origin", "destination", "date" (YYYY-MM-DD)'),
    "create_event": (
        "a calendar event",
        '"title", "date" (YYYY-MM-DD), "time" (HH:MM), "attendees" (a list of emails)',
    ),
    "lookup_order": ("an order's status and total", '"order_id"'),
    "convert_currency": ("an amount in another currency", '"amount", "from", "to" (ISO codes)'),
    "send_email": ("an email", '"to", "subject", "body"'),
}

CITIES = (
    "Lisbon", "Porto", "Madrid", "Seville", "Valencia", "Barcelona", "Marseille", "Toulouse",
    "Bordeaux", "Nantes", "Paris", "Brussels", "Antwerp", "Rotterdam", "Amsterdam", "Hamburg",
    "Berlin", "Leipzig", "Munich", "Vienna", "Zurich", "Geneva", "Milan", "Turin", "Bologna",
    "Florence", "Rome", "Naples", "Athens", "Sofia", "Bucharest", "Budapest", "Prague",
    "Krakow", "Warsaw", "Vilnius", "Riga", "Tallinn", "Helsinki", "Stockholm", "Oslo",
    "Copenhagen", "Dublin", "Edinburgh", "Manchester", "London", "Reykjavik", "Ljubljana",
)  # fmt: skip
FIRST_NAMES = (
    "Ada", "Bruno", "Chloe", "Dario", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas",
    "Kaori", "Luca", "Maya", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sami", "Tess", "Umar",
    "Vera", "Wim", "Xenia", "Yusuf", "Zoe", "Anouk", "Bjorn", "Carmen", "Dmitri",
)  # fmt: skip
LAST_NAMES = (
    "Alvarez", "Becker", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Horvat", "Ivanova",
    "Jansen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Quaresma",
    "Rossi", "Schmidt", "Tanaka", "Urbanek", "Virtanen", "Weber", "Yilmaz", "Zielinski",
)  # fmt: skip
DOMAINS = ("example.com", "example.org", "mail.example.net", "corp.example")
CURRENCIES = ("EUR", "USD", "GBP", "CHF", "SEK", "PLN", "JPY", "CAD")
AIRLINES = ("LH", "AF", "KL", "IB", "TP", "SK", "OS", "LX", "AZ", "FR", "U2")
CARRIERS = ("DHL", "UPS", "GLS", "DPD", "PostNL", "La Poste")
SKIES = ("sunny", "cloudy", "rain", "light rain", "fog", "snow", "windy", "clear")
MEETINGS = (
    "Quarterly review", "Budget sync", "Design critique", "Hiring panel", "Vendor call",
    "Sprint planning", "Launch rehearsal", "Security briefing", "Team lunch", "Offsite prep",
)  # fmt: skip
FIRST_DAY = datetime.date(2027, 1, 1)


def call_text(tool: str, **arguments) -> str:
    """A tool call as the model must write it: one line of JSON."""
    return json.dumps({"tool": tool, "arguments": arguments})


def tool_result(result: dict, next_step: str) -> str:
    """A tool's result handed back as a user turn, with the next step asked for."""
    return f"Tool result: {json.dumps(result)}\nNext: {next_step}"


def system_prompt() -> str:
    """The tools and the call format."""
    tools = "\n".join(
        f"- {name}: {what}. Arguments: {args}." for name, (what, args) in TOOLS.items()
    )
    return (
        f"You are an agent that acts only through tools. The tools:\n{tools}\n\n"
        "Answer every message with exactly one tool call and nothing else, one line of JSON: "
        f"{CALL_FORMAT}"
    )


def example(request: str, tool: str, **arguments) -> list[dict[str, str]]:
    """A worked example: a user turn and the call that answers it, as chat messages."""
    return [
        {"role": "user", "content": request},
        {"role": "assistant", "content": call_text(tool, **arguments)},
    ]


# Three earlier tickets, a call of each tool, with values from outside the tasks' pools (a
# copied example value shows in an answer).
EXAMPLES = [
    *example(
        "Ticket 00000000000000aa: Ola Nordmann flies from Bergen to Tromso on 2027-02-03. "
        "What is the weather in Tromso? Use celsius.",
        "get_weather",
        city="Tromso",
        unit="celsius",
    ),
    *example(
        tool_result(
            {"city": "Tromso", "temperature": -4, "unit": "celsius", "sky": "snow"},
            "find flights from Bergen to Tromso on 2027-02-03.",
        ),
        "search_flights",
        origin="Bergen",
        destination="Tromso",
        date="2027-02-03",
    ),
    *example(
        "Ticket 00000000000000bb: Book 'Board meeting' on 2027-02-10 at 09:00 with Kari "
        "Hansen (kari.hansen@example.no) and Per Berg (per.berg@example.no).",
        "create_event",
        title="Board meeting",
        date="2027-02-10",
        time="09:00",
        attendees=["kari.hansen@example.no", "per.berg@example.no"],
    ),
    *example(
        "Ticket 00000000000000cc: Kari Hansen asks how much order Q000001 came to, in EUR.",
        "lookup_order",
        order_id="Q000001",
    ),
    *example(
        tool_result(
            {"order_id": "Q000001", "status": "shipped", "total": 599.0, "currency": "NOK"},
            "convert 599.0 NOK to EUR.",
        ),
        "convert_currency",
        amount=599.0,
        **{"from": "NOK", "to": "EUR"},
    ),
    *example(
        tool_result(
            {"amount": 51.2, "currency": "EUR"},
            "email Kari Hansen at kari.hansen@example.no the amount.",
        ),
        "send_email",
        to="kari.hansen@example.no",
        subject="Order Q000001",
        body="Your order Q000001 came to 51.2 EUR.",
    ),
]
SYSTEM_PROMPT = system_prompt()
# What every conversation opens with: the system prompt, then the worked examples.
HEAD = [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLES]


def ticket(index: int) -> str:
    """Task `index`'s ticket number: 16 hex digits, a different one for every index below
    NUM_TASKS (an odd multiplier and an xor-shift are both one-to-one modulo 2**63)."""
    mixed = ((index + 1) * 0x9E3779B97F4A7C15) % 2**63
    return f"{mixed ^ (mixed >> 29):016x}"


def person(rng: random.Random) -> tuple[str, str]:
    """A name and an email address."""
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    return f"{first} {last}", f"{first}.{last}@{rng.choice(DOMAINS)}".lower()


def day(rng: random.Random) -> str:
    return (FIRST_DAY + datetime.timedelta(days=rng.randrange(365))).isoformat()


def order_id(rng: random.Random) -> str:
    return f"{rng.choice('ABCDEFGHJKMNPQRSTUVWXYZ')}{rng.randrange(10**6):06d}"


def trip(rng: random.Random, ref: str) -> Task:
    """Weather at the destination, then flights, then an email of the flight found."""
    origin, destination = rng.sample(CITIES, 2)
    date, unit = day(rng), rng.choice(("celsius", "fahrenheit"))
    name, email = person(rng)
    flight = f"{rng.choice(AIRLINES)}{rng.randrange(100, 10000)}"
    departs = f"{rng.randrange(6, 22):02d}:{rng.choice((0, 15, 30, 45)):02d}"
    price = rng.randrange(39, 900)
    celsius = rng.randrange(-5, 36)
    temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    weather = {"city": destination, "temperature": temperature, "unit": unit}
    weather["sky"] = rng.choice(SKIES)
    flights = {"flights": [{"flight": flight, "departs": departs, "price_eur": price}]}
    return Task(
        "trip",
        [
            f"Ticket {ref}: {name} flies from {origin} to {destination} on {date}. What is "
            f"the weather in {destination}? Use {unit}.",
            tool_result(weather, f"find flights from {origin} to {destination} on {date}."),
            tool_result(flights, f"email flight {flight} to {name} at {email}."),
        ],
        [
            {"tool": "get_weather", "arguments": {"city": destination, "unit": unit}},
            {
                "tool": "search_flights",
                "arguments": {"origin": origin, "destination": destination, "date": date},
            },
            {
                "tool": "send_email",
                "arguments": {
                    "to": email,
                    "subject": f"Flight {flight} to {destination}",
                    "body": f"Flight {flight} leaves {origin} at {departs} on {date}, {price} EUR.",
                },
            },
        ],
    )


def order(rng: random.Random, ref: str) -> Task:
    """An order's status, then an email to the customer."""
    name, email = person(rng)
    number, carrier, eta = order_id(rng), rng.choice(CARRIERS), day(rng)
    status = {"order_id": number, "status": "shipped", "carrier": carrier, "eta": eta}
    return Task(
        "order",
        [
            f"Ticket {ref}: {name} asks where order {number} is.",
            tool_result(status, f"email {name} at {email} with the status."),
        ],
        [
            {"tool": "lookup_order", "arguments": {"order_id": number}},
            {
                "tool": "send_email",
                "arguments": {
                    "to": email,
                    "subject": f"Order {number}",
                    "body": f"Your order {number} has shipped with {carrier}; it arrives on {eta}.",
                },
            },
        ],
    )


def meeting(rng: random.Random, ref: str) -> Task:
    """A calendar event for two people, then an email inviting the first."""
    title, date = rng.choice(MEETINGS), day(rng)
    time = f"{rng.randrange(8, 18):02d}:{rng.choice((0, 30)):02d}"
    (name_a, email_a), (name_b, email_b) = person(rng), person(rng)
    event = {"event_id": f"ev-{rng.randrange(16**8):08x}", "status": "created"}
    return Task(
        "meeting",
        [
            f"Ticket {ref}: Book '{title}' on {date} at {time} with {name_a} ({email_a}) "
            f"and {name_b} ({email_b}).",
            tool_result(event, f"email {name_a} the invitation."),
        ],
        [
            {
                "tool": "create_event",
                "arguments": {
                    "title": title,
                    "date": date,
                    "time": time,
                    "attendees": [email_a, email_b],
                },
            },
            {
                "tool": "send_email",
                "arguments": {
                    "to": email_a,
                    "subject": title,
                    "body": f"You are invited to {title} on {date} at {time}.",
                },
            },
        ],
    )


def refund(rng: random.Random, ref: str) -> Task:
    """An order's total, then the total in the customer's currency, then an email."""
    name, email = person(rng)
    number = order_id(rng)
    paid, wanted = rng.sample(CURRENCIES, 2)
    total = round(rng.uniform(5, 600), 2)
    converted = round(total * rng.uniform(0.5, 1.8), 2)
    looked_up = {"order_id": number, "status": "refunded", "total": total, "currency": paid}
    return Task(
        "refund",
        [
            f"Ticket {ref}: {name} wants to know how much was refunded for order {number}, "
            f"in {wanted}.",
            tool_result(looked_up, f"convert {total} {paid} to {wanted}."),
            tool_result(
                {"amount": converted, "currency": wanted},
                f"email {name} at {email} the refunded amount.",
            ),
        ],
        [
            {"tool": "lookup_order", "arguments": {"order_id": number}},
            {
                "tool": "convert_currency",
                "arguments": {"amount": total, "from": paid, "to": wanted},
            },
            {
                "tool": "send_email",
                "arguments": {
                    "to": email,
                    "subject": f"Refund for order {number}",
                    "body": f"We refunded {converted} {wanted} for order {number}.",
                },
            },
        ],
    )


KINDS: tuple[Callable[[random.Random, str], Task], ...] = (trip, order, meeting, refund)


def task(index: int) -> Task:
    """Task `index` (0 <= index < NUM_TASKS): its kind and values drawn from a generator
    seeded by the index, its ticket number the index's own."""
    if not 0 <= index < NUM_TASKS:
        raise IndexError(index)
    rng = random.Random(index)  # an int seed: the same draws in every process
    return rng.choice(KINDS)(rng, ticket(index))


class Tasks(Sequence[list[str]]):
    """Every task's user turns, task i at index i, generated when asked for: the
    conversations of walks.Workload, without end."""

    def __len__(self) -> int:
        return NUM_TASKS

    @overload
    def __getitem__(self, index: int) -> list[str]: ...

    @overload
    def __getitem__(self, index: slice) -> list[list[str]]: ...

    def __getitem__(self, index: int | slice) -> list[str] | list[list[str]]:
        if isinstance(index, slice):
            return [task(i).turns for i in range(*index.indices(NUM_TASKS))]
        return task(index).turns


TASKS = Tasks()
