"""Competition-style maths prompts (precalculus, intermediate algebra, geometry, number theory, counting), made
offline from templates.

The grade-school templates in `math_prompts` teach the drafter the target's step-by-step register well: on the
corpus's own held-out maths answers it reaches a rollout-order τ of 3.19 at T = 0, but on MATH-style competition
problems 2.36 (session 33). Those problems are longer, set in display LaTeX (`\\[ ... \\]`, matrices, sums,
piecewise functions, Asymptote figures), ask for answers in a stated form ("as a common fraction", "in interval
notation") and range over topics the simple templates never touch. The labels are the target's own answers,
right or wrong, so a prompt only has to draw out that register: each template below is a generic textbook genre
with seeded random numbers. No evaluation problem is copied, and `dspark data prompts --exclude` still drops any
prompt that shares content with an evaluation set.
"""

import math
from collections.abc import Iterator
from functools import partial

import numpy as np

from dspark.train.data import Prompt
from dspark.train.math_prompts import NAMES, Template, nonzero, signed, template_pool

WORDS = ("BALLOON", "LETTER", "COFFEE", "PEPPER", "BANANA", "TATTOO", "SUCCESS", "CIRCLE", "PUZZLE", "RECEDE",
         "ELEVEN", "GAMMA", "ALPACA", "COOKBOOK", "HAMMER", "PARALLEL")
ARCSINE_VALUES = ("-1", "0", "1", "\\frac{1}{2}", "-\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt{3}}{2}")
ANGLES = (0, 30, 45, 60, 90, 120, 135, 150, 180, 210, 225, 240, 270, 300, 315, 330)


def _frac(p: int, q: int) -> str:
    g = math.gcd(p, q)
    p, q = p // g, q // g
    if q < 0:
        p, q = -p, -q
    return str(p) if q == 1 else f"{'-' if p < 0 else ''}\\frac{{{abs(p)}}}{{{q}}}"


def _poly(coefficients: list[int], var: str = "x") -> str:
    """`[2, 0, -3, 1]` -> `2x^3 - 3x + 1` (highest power first)."""
    terms = []
    degree = len(coefficients) - 1
    for i, c in enumerate(coefficients):
        power = degree - i
        if c == 0:
            continue
        body = {0: "", 1: var}.get(power, f"{var}^{{{power}}}" if power > 9 else f"{var}^{power}")
        size = str(abs(c)) if abs(c) != 1 or power == 0 else ""
        sign = "-" if c < 0 else "+"
        terms.append((sign, size + body))
    if not terms:
        return "0"
    first_sign, first = terms[0]
    return ("-" if first_sign == "-" else "") + first + "".join(f" {sign} {t}" for sign, t in terms[1:])


def _linear(coefficients: tuple[int, ...], variables: str = "xyz") -> str:
    """`(-1, 2, 0)` -> `-x + 2y`."""
    terms = [(c, v) for c, v in zip(coefficients, variables, strict=False) if c]
    if not terms:
        return "0"
    text = "".join(f" {'-' if c < 0 else '+'} {'' if abs(c) == 1 else abs(c)}{v}" for c, v in terms)
    return text[3:] if text.startswith(" + ") else "-" + text[3:]


def _vector(values: tuple[int, ...]) -> str:
    return "\\begin{pmatrix} " + " \\\\ ".join(str(v) for v in values) + " \\end{pmatrix}"


def _matrix(rows: list[list[int]]) -> str:
    return "\\begin{pmatrix} " + " \\\\ ".join(" & ".join(str(v) for v in row) for row in rows) + " \\end{pmatrix}"


def polar_coordinates(rng):
    if rng.random() < 0.5:
        x, y = rng.choice([(1, 1), (-1, 1), (1, -1), (-1, -1), (-1, 0), (0, -1), (2, -2), (-3, 3)])
        k = rng.randint(2, 9)
        return (f"Write the point $({x * k}, {y * k})$, given in rectangular coordinates, in polar coordinates "
                "$(r,\\theta)$ with $r > 0$ and $-\\pi < \\theta \\le \\pi$.")
    r, den, num = rng.randint(1, 12), rng.choice([2, 3, 4, 6]), rng.randint(1, 11)
    return (f"Convert the point $\\left( {r}, \\frac{{{num} \\pi}}{{{den}}} \\right)$ in polar coordinates to "
            "rectangular coordinates.")


def spherical_coordinates(rng):
    rho, theta, phi = rng.randint(1, 12), rng.choice([2, 3, 4, 6]), rng.choice([2, 3, 4, 6])
    kind = rng.choice(["spherical", "cylindrical"])
    if kind == "spherical":
        point = f"(\\rho,\\theta,\\phi) = \\left( {rho}, \\frac{{\\pi}}{{{theta}}}, \\frac{{\\pi}}{{{phi}}} \\right)"
    else:
        point = f"\\left( {rho}, \\frac{{\\pi}}{{{theta}}}, {rng.randint(-9, 9)} \\right)"
    return f"Convert the point ${point}$ in {kind} coordinates to rectangular coordinates."


def vector_angle(rng):
    u = tuple(rng.randint(-5, 5) for _ in range(3))
    v = tuple(rng.randint(-5, 5) for _ in range(3))
    return rng.choice([
        f"Find the angle between the vectors ${_vector(u)}$ and ${_vector(v)},$ in degrees.",
        f"Find the cross product of ${_vector(u)}$ and ${_vector(v)}.$",
        f"Find the projection of ${_vector(u)}$ onto the vector ${_vector(v)}.$",
        f"For what value of $k$ are the vectors ${_vector(u)}$ and ${_vector(v[:2] + ('k',))}$ orthogonal?",
    ])


def line_through_points(rng):
    p = tuple(rng.randint(-6, 6) for _ in range(3))
    d = tuple(nonzero(rng, -4, 4) for _ in range(3))
    a, b = rng.randint(1, 6), rng.randint(1, 6)
    return rng.choice([
        f"The set of points $(x,y,z)$ that satisfy\n\\[{a}x = {b}y = -{a + b}z\\]is a line.  Find a direction vector "
        "of this line.",
        f"A line is parameterized by\n\\[{_vector(p)} + t {_vector(d)}.\\]Find the point where the line intersects "
        f"the $xy$-plane.",
        f"Find the distance from the point ${tuple(rng.randint(-5, 5) for _ in range(3))}$ to the plane "
        f"${_linear(d)} = {rng.randint(-10, 10)}.$",
    ])


def matrix(rng):
    m = [[rng.randint(-6, 6) for _ in range(2)] for _ in range(2)]
    n = [[rng.randint(-6, 6) for _ in range(2)] for _ in range(2)]
    big = [[rng.randint(-4, 4) for _ in range(3)] for _ in range(3)]
    return rng.choice([
        f"Find the inverse of the matrix\n\\[{_matrix(m)}.\\]If the inverse does not exist, then enter the zero "
        "matrix.",
        f"Compute $\\det {_matrix(big)}.$",
        f"Compute ${_matrix(m)} {_matrix(n)}.$",
        f"Let $\\mathbf{{A}} = {_matrix(m)}.$  Compute $\\mathbf{{A}}^{{{rng.randint(2, 4)}}}.$",
    ])


def complex_numbers(rng):
    a, b, c, d = (nonzero(rng, -9, 9) for _ in range(4))
    return rng.choice([
        f"Simplify $({a} {signed(b)}i)({c} {signed(d)}i)$.",
        f"Simplify $\\dfrac{{{a} {signed(b)}i}}{{{c} {signed(d)}i}}$. Your answer should be of the form $a+bi$, "
        "where $a$ and $b$ are both real numbers and written as improper fractions (if necessary).",
        f"Evaluate $|{a} {signed(b)}i|$.",
        f"Evaluate $i^{{{rng.randint(5, 999)}}} + i^{{{rng.randint(5, 999)}}} + i^{{{rng.randint(5, 999)}}}$.",
        f"Let $z = {a} {signed(b)}i$. Find $z^2 {signed(c)}\\overline{{z}}$.",
    ])


def trigonometry(rng):
    angle, function = rng.choice(ANGLES), rng.choice(["\\sin", "\\cos", "\\tan", "\\sec", "\\csc", "\\cot"])
    p = rng.randint(1, 6)
    q = p + rng.randint(1, 6)
    quadrant = rng.choice(["first", "second", "third", "fourth"])
    return rng.choice([
        f"Compute ${function} {angle}^\\circ$.",
        f"If $\\sin x = {_frac(p, q)}$ and $x$ lies in the {quadrant} quadrant, find $\\tan x$.",
        f"Find the period of $y = {function} {rng.randint(2, 6)}x$.",
        f"Compute $\\arcsin \\left( {rng.choice(ARCSINE_VALUES)} \\right)$, giving the angle in radians.",
        f"Simplify\n\\[\\frac{{\\sin {angle}^\\circ + \\sin {2 * angle % 360}^\\circ}}{{\\cos {angle}^\\circ + "
        f"\\cos {2 * angle % 360}^\\circ}}.\\]",
    ])


def polynomial_remainder(rng):
    coefficients = [nonzero(rng, -5, 5)] + [rng.randint(-9, 9) for _ in range(rng.randint(3, 5))]
    a = nonzero(rng, -4, 4)
    divisor = rng.choice([f"x {signed(-a)}", "x^2 - 1", f"x^2 {signed(a)}x", "2x - 1"])
    return rng.choice([
        f"Find the remainder when ${_poly(coefficients)}$ is divided by ${divisor}$.",
        f"What is the quotient when ${_poly(coefficients)}$ is divided by ${divisor}$?",
    ])


def vieta_cubic(rng):
    r, s, t = (nonzero(rng, -6, 6) for _ in range(3))
    k = nonzero(rng, -3, 3)
    coefficients = [k, -k * (r + s + t), k * (r * s + s * t + t * r), -k * r * s * t]
    ask = rng.choice(["a^2 + b^2 + c^2", "\\frac{1}{a} + \\frac{1}{b} + \\frac{1}{c}", "(a+1)(b+1)(c+1)",
                      "a^3 + b^3 + c^3", "\\frac{a}{bc} + \\frac{b}{ac} + \\frac{c}{ab}"])
    return f"Let $a,$ $b,$ and $c$ be the roots of ${_poly(coefficients)} = 0.$  Find ${ask}.$"


def rational_function(rng):
    a, b, c = rng.randint(1, 9), nonzero(rng, -9, 9), nonzero(rng, -9, 9)
    r, s = rng.sample(range(-7, 8), 2)
    numerator = _poly([a, b, c]) if rng.random() < 0.5 else _poly([a, b])
    denominator = _poly([1, -(r + s), r * s])
    return rng.choice([
        f"How many vertical asymptotes does the graph of $y=\\frac{{{numerator}}}{{{denominator}}}$ have?",
        f"Find the horizontal asymptote of the graph of $y=\\frac{{{numerator}}}{{{denominator}}}$, if it exists.",
        f"Let $f(x) = \\frac{{{a}x {signed(b)}}}{{x {signed(-r)}}}$. Compute $f({s}) \\cdot f({s + 1})$, giving "
        "the result in lowest terms.",
        f"Find $f^{{-1}}({c})$ if $f(x) = \\frac{{{a}x {signed(b)}}}{{x {signed(-r)}}}$.",
    ])


def domain_and_range(rng):
    a, b, c = rng.randint(1, 9), rng.randint(-20, 20), rng.randint(1, 30)
    r, s = sorted(rng.sample(range(-9, 10), 2))
    return rng.choice([
        f"What is the domain of the function $f(x) = \\sqrt{{{a}x {signed(b)}}} + \\frac{{1}}{{x {signed(-r)}}}$? "
        "Express your answer in interval notation.",
        f"Find all $x$ that satisfy the inequality $x^2 {signed(-(r + s))}x {signed(r * s)} < 0.$  Express your "
        "answer in interval notation.",
        f"What is the range of the function $y = \\frac{{x^2 {signed(-(r + s))}x {signed(r * s)}}}"
        f"{{x {signed(-r)}}}$? Express your answer using interval notation.",
        f"Find the smallest value of $x$ that satisfies $|{a}x {signed(b)}| \\le {c}$.",
    ])


def series(rng):
    k, n = rng.randint(1, 4), rng.randint(10, 100)
    p, q = rng.randint(1, 5), rng.randint(2, 9)
    return rng.choice([
        f"Compute\n\\[\\sum_{{n = 1}}^{{{n}}} \\frac{{1}}{{n(n + {k})}}.\\]",
        f"Compute\n\\[\\sum_{{n = 1}}^\\infty \\frac{{{p}}}{{{q}^n}}.\\]",
        f"Evaluate the infinite geometric series: $${p} - \\frac{{{p}}}{{{q}}} + \\frac{{{p}}}{{{q * q}}} - "
        f"\\frac{{{p}}}{{{q ** 3}}} + \\dots$$",
        f"Compute\n\\[\\sum_{{k = 1}}^\\infty \\frac{{k}}{{{q}^k}}.\\]",
        f"Find the sum of all positive integers $n \\le {n * 10}$ that are multiples of ${q}$ but not of "
        f"${q * p + 1}$.",
    ])


def recursive_sequence(rng):
    a1, a2, m = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 5)
    k = rng.randint(6, 30)
    return rng.choice([
        f"A sequence is defined by $a_1 = {a1},$ $a_2 = {a2},$ and\n\\[a_n = a_{{n - 1}} {signed(m)}a_{{n - 2}}\\]for "
        f"all $n \\ge 3.$  Find $a_{{{k}}}.$",
        f"A sequence $(a_n)$ satisfies $a_1 = {a1}$ and $a_{{n + 1}} = \\frac{{a_n}}{{1 + {m}a_n}}$ for $n \\ge 1$. "
        f"Find $a_{{{k}}}$.",
        f"Let $a_0 = {a1}$ and $a_{{n+1}} = {m}a_n {signed(-a2)}$ for $n \\ge 0$. What is the remainder when "
        f"$a_{{{k}}}$ is divided by $7$?",
    ])


def nonlinear_system(rng):
    x, y = rng.randint(-9, 9), rng.randint(-9, 9)
    return rng.choice([
        f"If $x + y = {x + y}$ and $xy = {x * y}$, what is the value of $x^2 + y^2$?",
        f"If $x + y = {x + y}$ and $xy = {x * y}$, what is the value of $x^3 + y^3$?",
        f"If $x - y = {x - y}$ and $x^2 + y^2 = {x * x + y * y}$, find $x^3 - y^3$.",
        f"The sum of two numbers is ${x + y}$ and the difference of their squares is ${x * x - y * y}$. What is the "
        "positive difference of the two numbers?",
    ])


def conic(rng):
    h, k, r = rng.randint(-9, 9), rng.randint(-9, 9), rng.randint(1, 12)
    a = nonzero(rng, -4, 4)
    return rng.choice([
        f"Find the center of the circle with equation $x^2 {signed(-2 * h)}x + y^2 {signed(-2 * k)}y = "
        f"{r * r - h * h - k * k}$.",
        f"What is the radius of the circle with equation $x^2 {signed(-2 * h)}x + y^2 {signed(-2 * k)}y "
        f"{signed(h * h + k * k - r * r)} = 0$?",
        f"Find the vertex of the parabola $y = {_poly([a, -2 * a * h, a * h * h + k])}$.",
        f"Find the focus of the parabola $y = {_poly([a, 0, k])}.$",
        f"Find the distance between the foci of the ellipse\n\\[\\frac{{x^2}}{{{(r + 2) ** 2}}} + "
        f"\\frac{{y^2}}{{{r * r}}} = 1.\\]",
    ])


def piecewise(rng):
    c, m, b = rng.randint(-5, 5), rng.randint(1, 6), rng.randint(-9, 9)
    return rng.choice([
        f"Let \\[f(x) = \\left\\{{\n\\begin{{array}}{{cl}} ax {signed(b)}, &\\text{{ if }}x>{c}, \\\\\nx^2 "
        f"{signed(-m)}, &\\text{{ if }} x \\le {c}.\n\\end{{array}}\n\\right.\\]Find $a$ if the graph of $y=f(x)$ is "
        "continuous.",
        f"Let \\[f(n) = \\left\\{{\n\\begin{{array}}{{cl}} n^2 {signed(b)} & \\text{{ if }}n<{c}, \\\\\n{m}n "
        f"{signed(-b)} & \\text{{ if }}n \\geq {c}.\n\\end{{array}}\n\\right.\\]Find $f({c - 3}) + f({c}) + "
        f"f({c + 4})$.",
    ])


def exponent_equation(rng):
    base, a, b = rng.choice([2, 3, 5]), rng.randint(1, 4), rng.randint(-5, 5)
    k = rng.randint(2, 4)
    return rng.choice([
        f"Solve for $x$: ${base}^{{x {signed(b)}}} = {base ** k}^{{{a}x}}$.",
        f"If $\\log_{{{base}}} (x {signed(b)}) + \\log_{{{base}}} (x) = {k}$, what is $x$?",
        f"Simplify $\\sqrt[{k}]{{{base ** (k * a)} \\cdot {base ** k}}}$.",
        f"What is the value of $\\left(\\frac{{{a}}}{{{a + 1}}}\\right)^{{-{k}}} \\cdot \\left(\\frac{{{a + 1}}}"
        f"{{{a}}}\\right)^{{{k - 1}}}$? Express your answer as a common fraction.",
    ])


def radicals(rng):
    square, rest = rng.randint(2, 12), rng.choice([2, 3, 5, 6, 7, 10, 11])
    a, b = rng.randint(1, 9), rng.choice([2, 3, 5, 7])
    return rng.choice([
        f"Simplify $\\sqrt{{{square * square * rest}}}$.",
        f"Rationalize the denominator of $\\frac{{{a}}}{{\\sqrt{{{b}}}}}$.",
        f"Rationalize the denominator: $\\frac{{1}}{{{a} + \\sqrt{{{b}}}}}$. Express your answer in simplest form.",
        f"Simplify $\\sqrt{{{rest * a * a}}} + \\sqrt{{{rest * 4}}} - \\sqrt{{{rest * 9}}}$.",
    ])


def regular_polygon(rng):
    n, side = rng.randint(5, 20), rng.randint(2, 30)
    return rng.choice([
        f"A regular polygon has {n} sides. What is the measure, in degrees, of each interior angle?",
        f"Each exterior angle of a regular polygon measures ${360 // n}^\\circ$ (rounded down to a whole number). "
        "How many sides does the polygon have?",
        f"Find the area of a regular hexagon with side length {side} cm. Give the exact value.",
        f"How many diagonals does a convex polygon with {n} sides have?",
        f"A regular octagon has perimeter ${8 * side}$ inches. What is the length, in inches, of one side?",
    ])


def triangle_figure(rng):
    x, y = rng.randint(25, 75), rng.randint(25, 75)
    z = 180 - x - y
    bx, cx, cy = rng.randint(4, 9), rng.randint(1, 6), rng.randint(3, 8)
    figure = (f"[asy]\ndraw((0,0)--({bx},0)--({cx},{cy})--cycle);\nlabel(\"$A$\",(0,0),SW);\n"
              f"label(\"$B$\",({bx},0),SE);\nlabel(\"$C$\",({cx},{cy}),N);\nlabel(\"${x}^\\circ$\",(0.8,0.3));\n"
              f"label(\"${y}^\\circ$\",({bx - 0.9},0.3));\n[/asy]")
    return rng.choice([
        f"In triangle $ABC$, shown below, what is the measure of $\\angle ACB$, in degrees?\n\n{figure}",
        f"In the diagram, $AB = {bx}$ and $\\angle CAB = {x}^\\circ$. What is the measure of the exterior angle at "
        f"$B$ if $\\angle ACB = {z}^\\circ$?\n\n{figure}",
        f"The triangle below has vertices $A(0,0)$, $B({bx},0)$ and $C({cx},{cy})$. What is its area?\n\n{figure}",
    ])


def coordinate_geometry(rng):
    points = [(rng.randint(-8, 8), rng.randint(-8, 8)) for _ in range(3)]
    (x1, y1), (x2, y2), (x3, y3) = points
    return rng.choice([
        f"What is the area, in square units, of a triangle with vertices at $A({x1}, {y1}), B({x2}, {y2})$ and "
        f"$C({x3}, {y3})$?",
        f"Find the perimeter of the triangle with vertices $({x1}, {y1})$, $({x2}, {y2})$ and $({x3}, {y3})$.",
        f"The points $({x1}, {y1})$, $({x2}, {y2})$ and $({x3}, k)$ lie on the same line. What is $k$?",
        f"Find the reflection of the point $({x1}, {y1})$ over the line $y = {_poly([nonzero(rng, -2, 2), y3])}$.",
    ])


def solids(rng):
    r, h, s = rng.randint(1, 12), rng.randint(1, 20), rng.randint(2, 15)
    return rng.choice([
        f"A right circular cone has radius {r} and height {h}. What is its volume? Express your answer in terms of "
        "$\\pi$.",
        f"A sphere has volume ${4 * r ** 3}\\pi/3$ cubic inches. What is its surface area? Express your answer in "
        "terms of $\\pi$.",
        f"A cube has surface area ${6 * s * s}$ square centimeters. What is the length of its space diagonal? Express "
        "your answer in simplest radical form.",
        f"A cylinder has radius {r} and height {h}. A cone with the same base and height is removed from it. What is "
        "the volume of the remaining solid? Express your answer in terms of $\\pi$.",
    ])


def repeating_decimal(rng):
    digits = str(rng.randint(1, 999)).zfill(rng.choice([1, 2, 3]))
    lead = rng.choice(["0", "0.", f"{rng.randint(1, 9)}"])
    value = f"0.\\overline{{{digits}}}" if lead == "0" else (f"0.{rng.randint(1, 9)}\\overline{{{digits}}}"
                                                           if lead == "0." else f"{lead}.\\overline{{{digits}}}")
    return rng.choice([
        f"Express ${value}$ as a common fraction in lowest terms.",
        f"What is the sum of the numerator and the denominator of ${value}$ written as a fraction in lowest terms?",
    ])


def digits_and_units(rng):
    a, n, m = rng.randint(2, 19), rng.randint(20, 2027), rng.randint(10, 60)
    return rng.choice([
        f"What is the units digit of ${a}^{{{n}}}$?",
        f"What are the last two digits of ${a}^{{{n}}}$?",
        f"How many zeros are at the end of ${m}!$?",
        f"What is the units digit of the sum $1! + 2! + 3! + \\cdots + {m}!$?",
        f"What is the largest power of ${rng.choice([2, 3, 5, 7])}$ that divides ${m}!$?",
    ])


def consecutive_integers(rng):
    k, power = rng.randint(2, 7), rng.choice(["perfect square", "perfect cube", "multiple of 10", "prime"])
    total = rng.randint(50, 500)
    few, start = min(k, 4), total // 20
    return rng.choice([
        f"Find the least {power} greater than {total} that equals the sum of {k + 1} consecutive positive "
        "integers.",
        f"The sum of {k} consecutive positive integers is ${k * total}$. What is the largest of these integers?",
        f"The product of {few} consecutive positive integers is ${math.prod(range(start, start + few))}$. What is "
        "their sum?",
    ])


def modular_arithmetic(rng):
    m = rng.choice([5, 7, 9, 11, 13, 17, 19, 23])
    terms = [rng.randint(100, 9999) for _ in range(rng.randint(3, 5))]
    a, b = rng.randint(2, 40), rng.randint(1, 40)
    product = " \\cdot ".join(map(str, terms[:3]))
    return rng.choice([
        f"What is the remainder when ${' + '.join(map(str, terms))}$ is divided by ${m}$?",
        f"Find the smallest positive integer $n$ such that ${a}n \\equiv {b} \\pmod{{{m}}}$.",
        f"What is the modulo ${m}$ remainder of $1 + 2 + 3 + \\dots + {terms[0]}$?",
        f"How many positive integers less than ${terms[0]}$ are congruent to ${b % m}$ (mod ${m}$)?",
        f"Find the remainder when ${product}$ is divided by ${m}$.",
    ])


def base_arithmetic(rng):
    base = rng.choice([2, 3, 4, 5, 6, 7, 8, 9])
    a, b = rng.randint(base, base ** 4), rng.randint(base, base ** 4)
    write = partial(np.base_repr, base=base)
    return rng.choice([
        f"Add ${write(a)}_{base} + {write(b)}_{base}.$ Express your answer in base ${base}.$",
        f"Find the product of ${write(a)}_{base} \\cdot {write(b % (base ** 2) + 1)}_{base}$. Express your answer in "
        f"base ${base}$.",
        f"What is ${write(a)}_{base}$ in base 10?",
        f"How many digits does the base-${base}$ representation of ${a * b}$ have?",
    ])


def counting(rng):
    word, n, k = rng.choice(WORDS), rng.randint(5, 12), rng.randint(2, 5)
    people = rng.randint(4, 30)
    return rng.choice([
        f"Determine the number of ways to arrange the letters of the word {word}.",
        f"{people} people attend a party. During the party everyone shakes hands with everyone else exactly once. "
        "How many handshakes take place at the party?",
        f"How many paths of length {n + k} are there from $(0,0)$ to $({n},{k})$ if each step moves one unit right "
        "or one unit up?",
        f"Count the distinct seatings of {n} guests at a circular table, where rotating everyone by the same number "
        "of seats gives the same seating.",
        f"How many {k}-digit positive integers have digits whose sum is ${rng.randint(3, 9 * k - 3)}$?",
        f"How many subsets of the set $\\{{1, 2, 3, \\dots, {n}\\}}$ contain at least one odd number?",
    ])


def probability(rng):
    n, k, sides = rng.randint(3, 10), rng.randint(1, 5), rng.choice([4, 6, 8, 12, 20])
    name = rng.choice(NAMES)
    return rng.choice([
        f"{name} flips {n} fair coins. What is the probability that at least {min(k, n)} of them come up heads? "
        "Express your answer as a common fraction.",
        f"What is the expected value of the roll of a fair {sides}-sided die whose faces are numbered from 1 to "
        f"{sides}? Express your answer as a decimal.",
        f"Two distinct integers are chosen at random from $1$ through ${n + 5}$. What is the probability that their "
        "sum is even? Express your answer as a common fraction.",
        f"A point $(x,y)$ is randomly picked from inside the rectangle with vertices $(0,0),({n},0),({n},{k}),$ and "
        f"$(0,{k})$. What is the probability that $x < {min(k, n)}y$? Express your answer as a common fraction.",
    ])


def statistics(rng):
    values = sorted(rng.randint(1, 99) for _ in range(rng.randint(5, 11)))
    rng.shuffle(values)
    n = rng.randint(10, 200)
    listed = ", ".join(map(str, values))
    return rng.choice([
        f"What is the positive difference between the median and the mean of the numbers {listed}? Express your "
        "answer as a decimal to the nearest tenth.",
        f"What is the median of the first ${n}$ positive integers? Express your answer as a decimal to the nearest "
        "tenth.",
        f"The mean of {len(values)} test scores is ${sum(values) // len(values)}$. {rng.choice(NAMES)} adds one more "
        f"score and the mean becomes ${sum(values) // len(values) + 2}$. What score was added?",
    ])


def word_problem(rng):
    a, b = rng.sample(NAMES, 2)
    x, y, z = rng.randint(2, 12), rng.randint(2, 12), rng.randint(20, 200)
    return rng.choice([
        f"{a} can paint a fence in {x} hours and {b} can paint it in {y} hours. How many hours will it take them to "
        "paint the fence together? Express your answer as a common fraction.",
        f"A train leaves a station at {x} a.m. travelling at {z} km/h. A second train leaves the same station "
        f"{y} hours later travelling at {z + 20} km/h in the same direction. How many hours after the second train "
        "leaves does it catch the first?",
        f"The ratio of {a}'s money to {b}'s money is ${x}:{y}$. Together they have \\${z * (x + y)}. How many dollars "
        f"does {a} have?",
        f"A store increases the price of a coat by ${x * 5}\\%$ and later decreases the new price by ${y * 5}\\%$. "
        "By what percent has the original price changed?",
    ])


TEMPLATES: dict[str, Template] = {f.__name__: f for f in (
    polar_coordinates, spherical_coordinates, vector_angle, line_through_points, matrix, complex_numbers,
    trigonometry, polynomial_remainder, vieta_cubic, rational_function, domain_and_range, series,
    recursive_sequence, nonlinear_system, conic, piecewise, exponent_equation, radicals, regular_polygon,
    triangle_figure, coordinate_geometry, solids, repeating_decimal, digits_and_units, consecutive_integers,
    modular_arithmetic, base_arithmetic, counting, probability, statistics, word_problem,
)}


def advanced_math_prompts(seed: int = 0, per_template: int = 200) -> Iterator[Prompt]:
    """Competition-style maths questions. Ids are `math-advanced/<template>/<seed>.<draw>`."""
    return template_pool(TEMPLATES, "math-advanced", seed, per_template)
