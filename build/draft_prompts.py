"""Training instructions for draft distillation: templated tasks over topics, plus
instructions the target writes itself. None of them is an evaluation prompt
(loadtest/prompts.jsonl); `training_prompts` drops any that is."""

from __future__ import annotations

import random

TOPICS = [
    "photosynthesis",
    "the water cycle",
    "black holes",
    "volcanoes",
    "the French Revolution",
    "the Roman Empire",
    "machine learning",
    "neural networks",
    "climate change",
    "vaccines",
    "the human heart",
    "sleep",
    "coffee",
    "bread baking",
    "gardening",
    "bees",
    "whales",
    "the Moon",
    "Mars",
    "electric cars",
    "solar panels",
    "wind power",
    "recycling",
    "the stock market",
    "inflation",
    "budgeting",
    "job interviews",
    "public speaking",
    "time management",
    "learning a language",
    "chess",
    "football",
    "running",
    "yoga",
    "meditation",
    "the internet",
    "email etiquette",
    "passwords",
    "cloud computing",
    "databases",
    "sorting algorithms",
    "recursion",
    "HTTP",
    "Git",
    "Linux",
    "Python lists",
    "JavaScript promises",
    "SQL joins",
    "unit testing",
    "APIs",
    "earthquakes",
    "rainbows",
    "magnets",
    "gravity",
    "friction",
    "the immune system",
    "DNA",
    "dinosaurs",
    "pyramids",
    "the printing press",
    "jazz",
    "photography",
    "painting",
    "poetry",
    "novels",
    "friendship",
    "kindness",
    "travel",
    "camping",
    "cooking pasta",
    "tea",
    "chocolate",
]
TASKS = [
    "Explain {t} in simple terms.",
    "What is {t}? Answer in two sentences.",
    "Give me three interesting facts about {t}.",
    "List five tips related to {t}.",
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Describe {t} to a ten-year-old.",
    "What are the advantages and disadvantages of {t}?",
    "Summarize the history of {t} in a short paragraph.",
    "Write a short story that involves {t}.",
    "Why is {t} important?",
    "How does {t} work?",
    "Give a step-by-step guide to getting started with {t}.",
    "Write a tweet about {t}.",
    "What are common misconceptions about {t}?",
    "Compare {t} with something similar and explain the difference.",
    "Write a one-paragraph product description inspired by {t}.",
    "Create a quiz question about {t} with its answer.",
    "What should a beginner know about {t}?",
    "Write a short email to a friend about {t}.",
]
CODE_TASKS = [
    "Write a Python function that {c}.",
    "Write a JavaScript function that {c}.",
    "Explain how to write code that {c}.",
    "Write a Python one-liner that {c}.",
]
CODE_GOALS = [
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a text",
    "returns the largest element of a list",
    "computes the factorial of n",
    "merges two sorted lists",
    "removes duplicates from a list",
    "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome",
    "computes the average of a list of numbers",
    "finds the most common letter in a string",
    "sums the digits of an integer",
    "flattens a nested list",
    "returns the n-th Fibonacci number",
    "validates an email address",
    "reads a file and counts its lines",
    "sorts a list of dictionaries by a key",
]
SHORT_QUESTIONS = [
    "What is the capital of {x}?",
    "What language is spoken in {x}?",
    "What is {a} plus {b}?",
    "What is {a} times {b}?",
    "How many minutes are in {a} hours?",
    "Is {a} an even number?",
    "What is the square of {a}?",
]
COUNTRIES = [
    "Japan",
    "Brazil",
    "Canada",
    "Kenya",
    "Norway",
    "Italy",
    "India",
    "Mexico",
    "Egypt",
    "Australia",
    "Germany",
    "Peru",
    "Vietnam",
    "Spain",
    "Chile",
]

# What the target is shown to make it write a user instruction of its own.
SELF_INSTRUCT_PREFIX = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\n"
)


def templated_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = set()
    while len(prompts) < count:
        kind = rng.random()
        if kind < 0.65:
            prompts.add(rng.choice(TASKS).format(t=rng.choice(TOPICS)))
        elif kind < 0.85:
            prompts.add(rng.choice(CODE_TASKS).format(c=rng.choice(CODE_GOALS)))
        else:
            prompts.add(
                rng.choice(SHORT_QUESTIONS).format(
                    x=rng.choice(COUNTRIES), a=rng.randint(2, 60), b=rng.randint(2, 60)
                )
            )
    return sorted(prompts)


def drop_evaluation_prompts(prompts: list[str], evaluation: list[str]) -> list[str]:
    held_out = {p.strip().lower() for p in evaluation}
    return [p for p in prompts if p.strip().lower() not in held_out]
