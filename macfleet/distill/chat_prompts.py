"""Ordinary chat requests for self-distillation: what people type into a chat box.

The topic and code sources ask about subjects; most of what a chat model answers is everyday
requests instead: advice for a situation, how a thing works, a description of a scene, a message
to rewrite or write, a comparison, a recommendation. This source builds them from lists of
situations, things, scenes, sentences and recipients crossed with phrasings (~6,000 prompts,
deterministic for a seed). The benchmark's held-out requests (prompts.HELD_OUT) and their
subjects (a camping trip, a refrigerator, a Saturday market) are deliberately absent from the
lists, so the benchmark still measures requests no answer was trained on.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

SITUATIONS = (
    "a job interview", "a first day at a new job", "a long flight", "a road trip with kids",
    "a beach holiday", "a week in a big city", "a ski trip", "a business trip", "a wedding",
    "a birthday party for a six-year-old", "a dinner party", "a picnic in the park",
    "a family reunion", "moving to a new apartment", "a rainy weekend at home",
    "a first date", "a school presentation", "a marathon", "a 5 km fun run", "a hospital stay",
    "a new puppy", "a new kitten", "a baby's first year", "starting university",
    "a semester abroad", "learning to drive", "buying a first home", "a home office setup",
    "a garage sale", "a bake sale", "a power outage", "a heat wave", "a snowstorm",
    "a long train journey", "a music festival", "a visit to a museum with children",
    "a cycling tour", "a day at the zoo", "a fishing trip", "a sailing weekend",
    "a volunteer day", "a team-building event", "a retirement party", "a housewarming party",
    "a baby shower", "a graduation ceremony", "a job fair", "a salary negotiation",
    "a performance review", "a difficult conversation with a friend", "a noisy neighbour",
    "a visit from in-laws", "a week without a car", "a digital detox weekend",
    "a study group", "final exams", "a cooking class", "a language exchange",
    "a first gym session", "a yoga retreat", "a garden makeover", "spring cleaning",
    "a kitchen renovation", "a small wedding on a budget", "a surprise party",
    "a trip to Japan", "a trip to Italy", "a trip to Mexico", "a trip to Norway",
    "a visit to a national park", "a day hike by the sea", "a long weekend in Paris",
    "a concert in a stadium", "a board game night", "a movie marathon", "a charity run",
    "working night shifts", "working from home with kids", "a new manager", "a career change",
    "a long-distance relationship", "caring for an elderly parent", "adopting a rescue dog",
    "a child's first sleepover", "teaching a teenager to cook", "a vegetarian month",
    "a budget grocery week", "planning a vegetable garden", "a podcast launch",
    "a small online shop", "a yard sale", "a book club meeting", "a science fair project",
    "a piano recital", "a swimming lesson", "an international move", "a visa interview",
    "a dentist appointment for a nervous child", "jet lag", "a winter cold",
    "a stressful week at work", "a sleepless newborn", "a tight deadline",
)
ADVICE = (
    "What should I bring to {x}?", "How do I prepare for {x}?", "Give me some tips for {x}.",
    "What are common mistakes people make with {x}?", "What should I know about {x}?",
    "Make a short checklist for {x}.", "What are three simple ways to make {x} easier?",
    "How can I save money on {x}?", "What should I do the day before {x}?",
    "How can I stay calm during {x}?", "Plan a simple schedule for {x}.",
    "What questions should I ask myself before {x}?",
)

THINGS = (
    "a microwave oven", "a dishwasher", "a washing machine", "a thermostat",
    "a smoke detector", "a light bulb", "an LED", "a battery", "a solar panel", "a wind turbine",
    "a bicycle's gears", "a car engine", "brakes on a car", "an airplane wing",
    "a helicopter", "a submarine", "a hot-air balloon", "an elevator", "an escalator",
    "a lock and key", "a zipper", "a compass", "a camera", "a telescope", "a microscope",
    "a thermometer", "a barometer", "a clock", "a smartphone touchscreen", "Wi-Fi",
    "Bluetooth", "a QR code", "a barcode scanner", "a credit card chip", "an ATM",
    "a search engine", "email", "a web browser", "a password manager", "a printer",
    "noise-cancelling headphones", "a speaker", "a microphone", "a radio", "television",
    "a vacuum cleaner", "a kettle", "a toaster", "a pressure cooker", "an induction hob",
    "an air conditioner", "a heat pump", "a water filter", "a dam", "a lighthouse",
    "a traffic light", "a bridge", "a tunnel", "a sewer system", "recycling plants",
    "rain", "thunder and lightning", "a rainbow", "the tides", "the seasons", "wind",
    "fog", "snowflakes", "a volcano", "an earthquake", "ocean waves", "a cloud",
    "the northern lights", "an eclipse", "the phases of the Moon", "a shooting star",
    "yeast in bread", "soap", "sunscreen", "a vaccine", "a fever", "a sneeze", "hiccups",
    "muscle growth", "digestion", "sleep", "memory", "a heartbeat", "breathing",
    "a bee making honey", "a caterpillar becoming a butterfly", "bird migration",
    "a tree growing", "a seed sprouting", "composting", "coffee roasting", "ice cream making",
    "popcorn popping", "a candle burning", "rust", "a magnet", "static electricity",
    "a mirror", "a lens", "glass making", "paper making", "a pencil", "a ballpoint pen",
)
EXPLAIN = (
    "Explain how {x} works.", "How does {x} work? Keep it simple.",
    "Explain {x} to a ten-year-old.", "What happens inside {x}?",
    "Explain the science behind {x} in a few sentences.", "Tell me about {x}.",
    "Give a step-by-step explanation of how {x} works.", "What is {x}, and how does it work?",
)

SCENES = (
    "a quiet library on a rainy afternoon", "a train station at rush hour",
    "a beach at sunset", "a small bakery early in the morning", "a snowy village at night",
    "a crowded concert", "a hospital waiting room", "a school playground at lunchtime",
    "an old bookshop", "a forest after rain", "a mountain lake at dawn", "a desert at noon",
    "a harbour full of fishing boats", "a city park in autumn", "a busy restaurant kitchen",
    "a classroom before an exam", "an airport departure hall", "a football stadium on match day",
    "a small town main street", "a garden in spring", "a thunderstorm over the sea",
    "a coffee shop on a Monday morning", "a farm at sunrise", "a night sky in the countryside",
    "a museum of natural history", "a subway carriage late at night", "a wedding reception",
    "a birthday party", "a rainforest", "a coral reef", "a frozen lake", "a vineyard in summer",
    "a lighthouse in a storm", "a skyscraper rooftop", "an empty theatre",
    "a children's hospital ward decorated for the holidays", "a street festival",
    "a fishing village", "a ski resort", "a desert oasis", "a space station",
    "a medieval castle", "a country road in the fog", "a laundromat at midnight",
    "a bus stop in the rain", "a mountain hut", "a sunflower field", "a tide pool",
)
DESCRIBE = (
    "Describe {x}.", "Write a short paragraph describing {x}.",
    "Describe the sounds and smells of {x}.", "Describe {x} in three sentences.",
    "Write a vivid description of {x} for a story.", "What would you see in {x}?",
)

OPENERS = ("hey", "hi", "yo", "ok so", "hello", "hey there", "sorry but")
ASKS = ("can u send me", "could you forward", "pls share", "can you get me", "need",
        "send over", "can u check")
ITEMS = ("the slides", "the invoice", "the meeting notes", "the budget", "the photos",
         "the contract", "the schedule", "the code", "the draft", "the numbers", "the list",
         "the tickets")
WHENS = ("by friday", "asap", "before the meeting", "tonight", "this week", "by monday",
         "when u can", "by noon")
CLOSERS = ("thx", "cheers", "ty!", "thanks a lot", "appreciate it", "", "lol thanks")
REWRITE = (
    "Rewrite this sentence to sound more formal: {x}", "Make this message more polite: {x}",
    "Fix the spelling and grammar: {x}", "Rewrite this as a professional email: {x}",
    "Turn this into a friendly but clear request: {x}",
)

RECIPIENTS = ("my landlord", "my manager", "a teacher", "a neighbour", "a customer",
              "my team", "a client", "a friend", "my doctor", "a colleague", "the school",
              "a hotel", "an airline", "a shop", "my grandmother")
PURPOSES = ("a broken heater", "a missed deadline", "a schedule change", "a late payment",
            "a thank-you for their help", "a meeting request", "a complaint about noise",
            "a refund", "a day off", "an invitation to dinner", "a lost package",
            "a recommendation letter", "an apology for being late", "a price question",
            "a booking change", "good news about a project")
WRITE = (
    "Write a short email to {r} about {p}.", "Write a polite message to {r} about {p}.",
    "Draft a brief note to {r} about {p}.",
)

PAIRS = (
    ("tea", "coffee"), ("cats", "dogs"), ("renting", "buying a home"), ("trains", "planes"),
    ("e-books", "paper books"), ("running", "swimming"), ("a laptop", "a tablet"),
    ("saving", "investing"), ("baking", "frying"), ("weather", "climate"),
    ("a virus", "bacteria"), ("speed", "velocity"), ("mass", "weight"), ("RAM", "storage"),
    ("a lake", "a pond"), ("a crocodile", "an alligator"), ("empathy", "sympathy"),
    ("a credit card", "a debit card"), ("butter", "margarine"), ("HTTP", "HTTPS"),
    ("a city", "a town"), ("jam", "jelly"), ("a comet", "an asteroid"), ("yoga", "pilates"),
    ("tennis", "badminton"), ("a hurricane", "a tornado"), ("Python", "JavaScript"),
    ("a novel", "a short story"), ("a simile", "a metaphor"), ("fruits", "vegetables"),
)
COMPARE = ("What is the difference between {a} and {b}?", "Should I choose {a} or {b}? Why?",
           "Compare {a} and {b} in a short table.", "What do {a} and {b} have in common?")

GENRES = ("books", "board games", "podcasts", "hobbies", "houseplants", "easy recipes",
          "weekend activities", "apps", "exercises", "gifts", "films", "songs")
FOR_WHOM = ("a beginner", "a ten-year-old", "someone who loves history", "a busy parent",
            "a retired teacher", "a small apartment", "a rainy day", "a student on a budget",
            "someone learning to relax", "a long train ride")
RECOMMEND = ("Recommend some {g} for {w}.", "What are good {g} for {w}?",
             "Suggest five {g} for {w}, with one line about each.")


def _pairs(rng: random.Random) -> Iterator[tuple[str, str, str]]:
    """(kind, text, group) of every request, shuffled once."""
    out = [("advice", t.format(x=s), s) for s in SITUATIONS for t in ADVICE]
    out += [("explain", t.format(x=s), s) for s in THINGS for t in EXPLAIN]
    out += [("describe", t.format(x=s), s) for s in SCENES for t in DESCRIBE]
    for o, a, i, w, c in itertools.product(OPENERS, ASKS, ITEMS, WHENS, CLOSERS):
        if rng.random() < 0.05:  # ~2,200 of the 47,000 messages
            msg = f"{o}, {a} {i} {w}? {c}".strip()
            out.append(("rewrite", rng.choice(REWRITE).format(x=msg), i))
    out += [("write", t.format(r=r, p=p), p) for r in RECIPIENTS for p in PURPOSES
            for t in WRITE]
    out += [("compare", t.format(a=a, b=b), f"{a}/{b}") for a, b in PAIRS for t in COMPARE]
    out += [("recommend", t.format(g=g, w=w), g) for g in GENRES for w in FOR_WHOM
            for t in RECOMMEND]
    rng.shuffle(out)
    yield from out


def chat_prompts(rng: random.Random) -> Iterator[tuple[str, str]]:
    """(text, group) of ordinary chat requests; the group is the kind and its subject (held-out
    figures hold out whole groups)."""
    for kind, text, subject in _pairs(rng):
        yield text, f"chat:{kind}:{subject}"


def every_chat_prompt() -> Iterator[tuple[str, str]]:
    """(kind, text) of every request these lists can make, whatever the seed (the rewrite
    family's every message in every phrasing, where `chat_prompts` samples 5% of them): what a
    held-out request must not near-copy (contamination_sources)."""
    yield from (("advice", t.format(x=s)) for s in SITUATIONS for t in ADVICE)
    yield from (("explain", t.format(x=s)) for s in THINGS for t in EXPLAIN)
    yield from (("describe", t.format(x=s)) for s in SCENES for t in DESCRIBE)
    for o, a, i, w, c in itertools.product(OPENERS, ASKS, ITEMS, WHENS, CLOSERS):
        msg = f"{o}, {a} {i} {w}? {c}".strip()
        yield from (("rewrite", t.format(x=msg)) for t in REWRITE)
    yield from (("write", t.format(r=r, p=p)) for r in RECIPIENTS for p in PURPOSES
                for t in WRITE)
    yield from (("compare", t.format(a=a, b=b)) for a, b in PAIRS for t in COMPARE)
    yield from (("recommend", t.format(g=g, w=w)) for g in GENRES for w in FOR_WHOM
                for t in RECOMMEND)
