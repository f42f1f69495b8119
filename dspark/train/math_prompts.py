"""Synthetic maths prompts for self-distillation, made offline from templates.

No maths training set ships on the package registries this project may use (the evaluation sets
must never be trained on), yet maths is where the default drafter is weakest. For self-distillation
the prompt only has to draw out the target's maths register — step-by-step reasoning, LaTeX, a boxed
answer — because the labels are the target's own answers, right or wrong. So each template below is a
competition- or word-problem-style question with random numbers; the pool is finite and seeded, and
every prompt id names its template and numbers.
"""

import random
from collections.abc import Callable, Iterator

from dspark.train.data import Prompt

STEP_BY_STEP = "Please reason step by step, and put your final answer within \\boxed{}."
NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Keiko", "Liam",
         "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq")
ITEMS = ("apples", "stickers", "marbles", "books", "cookies", "pencils", "stamps", "shells", "cards", "coins")


def nonzero(rng: random.Random, low: int, high: int) -> int:
    """A random integer in [low, high] other than 0 (a coefficient that must not vanish)."""
    value = 0
    while value == 0:
        value = rng.randint(low, high)
    return value


def signed(value: int) -> str:
    """`3` -> `+ 3`, `-3` -> `- 3`: a term written after another."""
    return f"+ {value}" if value >= 0 else f"- {-value}"


# Each template draws its numbers and returns the question (without the closing instruction).
Template = Callable[[random.Random], str]


def linear_equation(rng):
    a, c = rng.sample(range(2, 13), 2)
    return f"Solve for $x$: ${a}x {signed(rng.randint(-30, 30))} = {c}x {signed(rng.randint(-30, 30))}$."


def linear_system(rng):
    a, b, d, e = (rng.randint(1, 9) for _ in range(4))
    x, y = rng.randint(-9, 9), rng.randint(-9, 9)
    ask = rng.choice(["$x + y$", "$x - y$", "$xy$", "$x$", "$y$"])
    return (f"If ${a}x + {b}y = {a * x + b * y}$ and ${d}x - {e}y = {d * x - e * y}$, what is the value of "
            f"{ask}?")


def quadratic_roots(rng):
    r, s = rng.randint(-12, 12), rng.randint(-12, 12)
    ask = rng.choice(["the sum of the squares of the roots", "the product of the roots", "the positive difference "
                      "between the roots", "the sum of the reciprocals of the roots"])
    return f"What is {ask} of $x^2 {signed(-(r + s))}x {signed(r * s)} = 0$?"


def function_value(rng):
    a, b, c, n = rng.randint(1, 9), rng.randint(-20, 20), rng.randint(-20, 20), rng.randint(-6, 6)
    return f"Let $f(x) = {a}x^2 {signed(b)}x {signed(c)}$. What is $f({n})$?"


def composition(rng):
    a, b, c, n = rng.randint(2, 9), rng.randint(-10, 10), rng.randint(1, 20), rng.randint(-5, 5)
    outer = rng.choice(["f(g", "g(f"])
    return f"If $f(x) = {a}x {signed(b)}$ and $g(x) = x^2 - {c}$, what is ${outer}({n}))$?"


def gcd_lcm(rng):
    base = rng.randint(2, 30)
    m, n = base * rng.randint(2, 40), base * rng.randint(2, 40)
    word = rng.choice(["greatest common divisor", "least common multiple"])
    return f"What is the {word} of ${m}$ and ${n}$?"


def power_remainder(rng):
    a, k, m = rng.randint(2, 19), rng.randint(10, 2026), rng.randint(3, 13)
    return f"What is the remainder when ${a}^{{{k}}}$ is divided by ${m}$?"


def divisor_count(rng):
    n = rng.choice([2, 3, 5, 7]) ** rng.randint(1, 4) * rng.choice([1, 3, 5, 11, 13]) ** rng.randint(0, 3)
    return rng.choice([f"How many positive divisors does ${n}$ have?",
                       f"What is the sum of the positive divisors of ${n}$?"])


def digit_sum(rng):
    a, b = rng.randint(12, 999), rng.randint(12, 999)
    return f"What is the sum of the digits of ${a} \\times {b}$?"


def base_conversion(rng):
    n, base = rng.randint(20, 3000), rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 12, 16])
    return f"Convert ${n}_{{10}}$ to base ${base}$."


def arithmetic_sequence(rng):
    a, d = rng.randint(-20, 40), nonzero(rng, -9, 9)
    k, j = rng.sample(range(3, 60), 2)
    return (f"The first term of an arithmetic sequence is ${a}$ and the {k}th term is ${a + (k - 1) * d}$. "
            f"What is the {j}th term?")


def geometric_series(rng):
    a, r, n = rng.randint(1, 9), rng.choice([2, 3, -2, 4, 5]), rng.randint(4, 10)
    return (f"What is the sum of the first {n} terms of the geometric sequence ${a}, {a * r}, {a * r * r}, "
            f"\\dots$?")


def committee(rng):
    n, k = rng.randint(6, 20), rng.randint(2, 5)
    kind = rng.choice([f"a committee of {k} people be chosen from a group of {n} people",
                       f"{k} distinct books be arranged on a shelf chosen from {n} different books",
                       f"the letters of a {n if n < 10 else 9}-letter word with all letters different be arranged"])
    return f"In how many ways can {kind}?"


def dice(rng):
    total = rng.randint(2, 12)
    event = rng.choice([f"the sum is {total}", f"the sum is at least {total}", "the product is even",
                        "the two numbers differ by 1", f"at least one die shows a {rng.randint(1, 6)}"])
    return f"Two fair six-sided dice are rolled. What is the probability that {event}? Express your answer as a " \
           "common fraction."


def marbles(rng):
    red, blue = rng.randint(2, 12), rng.randint(2, 12)
    event = rng.choice(["both are red", "both are the same color", "one is red and one is blue"])
    return (f"A bag contains {red} red marbles and {blue} blue marbles. Two marbles are drawn at random without "
            f"replacement. What is the probability that {event}? Express your answer as a common fraction.")


def rectangle(rng):
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    return rng.choice([f"A rectangle has perimeter {2 * (a + b)} and one side of length {a}. What is its area?",
                       f"A rectangle has area {a * b} and one side of length {a}. What is the length of its "
                       "diagonal? Express your answer in simplest radical form."])


def right_triangle(rng):
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    return rng.choice([f"The legs of a right triangle have lengths {a} and {b}. What is the length of the "
                       "hypotenuse? Express your answer in simplest radical form.",
                       f"A right triangle has legs {a} and {b}. What is the length of the altitude to the "
                       "hypotenuse?"])


def circle(rng):
    c = rng.randint(2, 40)
    return rng.choice([f"A circle has circumference ${c}\\pi$. What is its area? Express your answer in terms of "
                       "$\\pi$.",
                       f"A circle is inscribed in a square of side length {c}. What is the area of the region inside "
                       "the square but outside the circle? Express your answer in terms of $\\pi$."])


def percent(rng):
    price, off, tax = rng.randint(12, 400), rng.choice([10, 15, 20, 25, 30, 40]), rng.choice([5, 6, 8, 10])
    return (f"A jacket costs \\${price}. It is discounted by {off}\\%, and then a {tax}\\% sales tax is added to the "
            "discounted price. What is the final price, in dollars?")


def rate(rng):
    d, h, d2 = rng.randint(30, 400), rng.randint(2, 8), rng.randint(30, 900)
    name = rng.choice(NAMES)
    return (f"{name} drives {d} miles in {h} hours. At the same average speed, how many hours will it take "
            f"{name} to drive {d2} miles?")


def integer_count(rng):
    k, b = rng.randint(2, 9), rng.randint(-20, 20)
    low = rng.randint(-60, 30)
    high = low + rng.randint(10, 90)
    return f"How many integers $n$ satisfy ${low} < {k}n {signed(b)} < {high}$?"


def expand(rng):
    a, b, c, d = (nonzero(rng, -9, 9) for _ in range(4))
    return f"Expand the product $({a}x {signed(b)})({c}x {signed(d)})$."


def logarithm(rng):
    base, k, m = rng.choice([2, 3, 5, 10]), rng.randint(2, 6), rng.randint(2, 4)
    return rng.choice([f"Evaluate $\\log_{{{base}}} {base ** k}$.",
                       f"Evaluate $\\log_{{{base ** m}}} {base ** (k * m)}$."])


def average(rng):
    n, mean = rng.randint(4, 12), rng.randint(10, 90)
    removed = rng.randint(1, 2 * mean)
    return (f"The average of {n} numbers is {mean}. If the number {removed} is removed from the list, what is the "
            "average of the remaining numbers?")


def modular_inverse(rng):
    m = rng.choice([7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47])
    a = rng.randint(2, m - 1)
    return f"Find the inverse of ${a}$ modulo ${m}$. Express your answer as an integer from $0$ to ${m - 1}$."


def distance(rng):
    x1, y1, x2, y2 = (rng.randint(-12, 12) for _ in range(4))
    return rng.choice([f"What is the distance between the points $({x1}, {y1})$ and $({x2}, {y2})$?",
                       f"What is the midpoint of the segment with endpoints $({x1}, {y1})$ and $({x2}, {y2})$?"])


def line(rng):
    x1, y1, y2 = rng.randint(-9, 9), rng.randint(-9, 9), rng.randint(-9, 9)
    x2 = x1 + nonzero(rng, -6, 6)
    return (f"Find the equation of the line that passes through $({x1}, {y1})$ and $({x2}, {y2})$. Write it in the "
            "form $y = mx + b$.")


def absolute_value(rng):
    a, b, c = rng.randint(1, 9), rng.randint(-20, 20), rng.randint(1, 30)
    return f"What is the sum of all values of $x$ that satisfy $|{a}x {signed(-b)}| = {c}$?"


def floor_ceiling(rng):
    p, q = rng.randint(3, 99), rng.randint(2, 13)
    return f"Evaluate $\\left\\lceil \\frac{{{p}}}{{{q}}} \\right\\rceil + \\left\\lfloor -\\frac{{{p}}}{{{q}}} " \
           "\\right\\rfloor$."


def shopping(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, bags, per, given = rng.randint(3, 60), rng.randint(2, 9), rng.randint(3, 24), rng.randint(1, 30)
    return (f"{name} has {a} {item}. {name} buys {bags} packs with {per} {item} in each pack and then gives {given} "
            f"{item} to a friend. How many {item} does {name} have now?")


def wages(rng):
    name = rng.choice(NAMES)
    rate_, hours, extra = rng.randint(9, 45), rng.randint(10, 50), rng.randint(2, 15)
    return (f"{name} earns \\${rate_} per hour for the first 40 hours of a week and 1.5 times that rate for every "
            f"hour after 40. Last week {name} worked {hours + extra} hours. How much did {name} earn?")


def ages(rng):
    a, b = rng.sample(NAMES, 2)
    k, years = rng.randint(2, 5), rng.randint(2, 15)
    young = rng.randint(3, 20)
    return (f"{a} is {k} times as old as {b}. In {years} years, {a} will be {k * young + years} years old. How old is "
            f"{b} now?")


def mixture(rng):
    x, p1, y, p2 = rng.randint(2, 20), rng.choice([10, 20, 25, 30]), rng.randint(2, 20), rng.choice([40, 50, 60, 75])
    return (f"A chemist mixes {x} liters of a {p1}\\% acid solution with {y} liters of a {p2}\\% acid solution. "
            "What is the percentage of acid in the mixture?")


TEMPLATES: dict[str, Template] = {f.__name__: f for f in (
    linear_equation, linear_system, quadratic_roots, function_value, composition, gcd_lcm, power_remainder,
    divisor_count, digit_sum, base_conversion, arithmetic_sequence, geometric_series, committee, dice, marbles,
    rectangle, right_triangle, circle, percent, rate, integer_count, expand, logarithm, average, modular_inverse,
    distance, line, absolute_value, floor_ceiling, shopping, wages, ages, mixture,
)}


def template_pool(templates: dict[str, Template], source: str, seed: int = 0,
                  per_template: int = 400) -> Iterator[Prompt]:
    """A finite, seeded pool of prompts, templates interleaved; most end with the usual step-by-step,
    boxed-answer instruction, the rest are asked plainly. Ids are `<source>/<template>/<seed>.<draw>`, and each
    prompt depends only on its id, so a pool can grow without changing the prompts already drawn."""
    rng = random.Random(seed)
    draws = [(name, draw) for draw in range(per_template) for name in templates]
    rng.shuffle(draws)
    for name, draw in draws:
        local = random.Random(f"{seed}/{name}/{draw}")
        question = templates[name](local)
        text = f"{question}\n{STEP_BY_STEP}" if local.random() < 0.8 else question
        yield Prompt(f"{source}/{name}/{seed}.{draw}", source, [{"role": "user", "content": text}])


def math_prompts(seed: int = 0, per_template: int = 400) -> Iterator[Prompt]:
    """Grade-school to early-competition maths questions. Ids are `math/<template>/<seed>.<draw>`."""
    return template_pool(TEMPLATES, "math", seed, per_template)
