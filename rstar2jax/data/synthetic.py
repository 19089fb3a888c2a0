"""A synthetic math task where running Python helps: short problems with integer answers.

Ten families (modular powers, digit sums of big powers, products and power sums mod m, divisibility and
digit-sum counting, gcd / lcm, lattice paths, Fibonacci mod m), each at difficulty 1-3 (bigger numbers, so
mental arithmetic fails sooner and the brute-force code runs longer). Every problem carries a short reference
Python solution that prints the answer. The answer itself is computed by a different route where one exists
(closed form, DP, fast doubling), so running the snippet is a real check of both.

Splits are disjoint by construction: a problem's split is a hash of its family and parameters, so a held-out
problem can never be drawn for training, whatever the seed or sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import random
from collections.abc import Callable, Sequence

from rstar2jax.data.problems import Problem

DIFFICULTIES = (1, 2, 3)
# Share of the parameter space (by hash) reserved for the held-out split.
EVAL_SHARE = 0.2
# Draws allowed per requested problem before giving up on a too small parameter space.
_MAX_DRAWS_PER_PROBLEM = 2000


@dataclasses.dataclass(frozen=True)
class SyntheticProblem:
    """One generated problem.

    Attributes:
      id: ``"{family}-{hash}"``, a function of family and parameters only (same problem, same id).
      problem: the natural-language problem text.
      answer: the integer answer as a decimal string.
      family: the family name (a key of ``FAMILIES``).
      difficulty: 1 (small numbers) to 3 (large numbers).
      solution: a short Python program that prints ``answer``.
    """

    id: str
    problem: str
    answer: str
    family: str
    difficulty: int
    solution: str

    def as_problem(self) -> Problem:
        """The generic RL ``Problem`` (family, difficulty and solution go to its metadata)."""
        metadata = {"family": self.family, "difficulty": self.difficulty, "solution": self.solution}
        return Problem(id=self.id, problem=self.problem, answer=self.answer, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """The train and held-out splits of one generated task (no problem in both)."""

    train: list[SyntheticProblem]
    eval: list[SyntheticProblem]


@dataclasses.dataclass(frozen=True)
class _Draw:
    params: tuple[int, ...]
    problem: str
    answer: int
    solution: str


def _pick(rng: random.Random, difficulty: int, ranges: Sequence[tuple[int, int]]) -> int:
    """A uniform integer from the inclusive range for this difficulty (``ranges`` has one per level)."""
    lo, hi = ranges[difficulty - 1]
    return rng.randint(lo, hi)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _random_prime(rng: random.Random, lo: int, hi: int) -> int:
    """A random prime in [lo, hi] (the ranges used here always contain one)."""
    start = rng.randint(lo, hi)
    return next(p for p in itertools.chain(range(start, hi + 1), range(lo, start)) if _is_prime(p))


# --- families: each draws parameters for a difficulty and returns text, answer and a reference snippet ---


def _modpow(rng: random.Random, difficulty: int) -> _Draw:
    a = _pick(rng, difficulty, [(2, 9), (2, 99), (100, 9999)])
    b = _pick(rng, difficulty, [(10, 99), (100, 9999), (10**4, 10**6)])
    m = _pick(rng, difficulty, [(10, 999), (100, 99999), (10**5, 10**9)])
    answer, base, exponent = 1 % m, a % m, b  # square-and-multiply
    while exponent:
        if exponent & 1:
            answer = answer * base % m
        base, exponent = base * base % m, exponent >> 1
    code = f"a, b, m = {a}, {b}, {m}\nprint(pow(a, b, m))"
    return _Draw((a, b, m), f"Compute {a}^{b} mod {m}.", answer, code)


def _digit_sum_power(rng: random.Random, difficulty: int) -> _Draw:
    a = _pick(rng, difficulty, [(2, 20), (2, 50), (2, 99)])
    b = _pick(rng, difficulty, [(10, 99), (50, 300), (200, 1000)])
    value, answer = a**b, 0
    while value:
        value, digit = divmod(value, 10)
        answer += digit
    code = f"n = {a} ** {b}\nprint(sum(int(d) for d in str(n)))"
    return _Draw((a, b), f"Find the sum of the digits of {a}^{b}.", answer, code)


def _product_mod(rng: random.Random, difficulty: int) -> _Draw:
    lo = _pick(rng, difficulty, [(1, 20), (1, 200), (1, 5000)])
    hi = lo + _pick(rng, difficulty, [(5, 30), (20, 300), (500, 5000)])
    # A prime modulus above hi keeps the product from collapsing to 0.
    m = _random_prime(rng, hi + 1, [100, 1000, 10**6][difficulty - 1] + hi)
    code = f"lo, hi, m = {lo}, {hi}, {m}\np = 1\nfor k in range(lo, hi + 1):\n    p = p * k % m\nprint(p)"
    text = f"Find the product of the integers from {lo} to {hi}, modulo {m}."
    # Bignum math.prod is slow for thousands of factors; reduce as we go.
    return _Draw((lo, hi, m), text, functools.reduce(lambda p, k: p * k % m, range(lo, hi + 1), 1), code)


def _count_divisible(rng: random.Random, difficulty: int) -> _Draw:
    n = _pick(rng, difficulty, [(50, 500), (1000, 10**5), (10**5, 10**6)])
    a, b = rng.sample(range(2, [13, 51, 201][difficulty - 1]), 2)
    answer = n // a + n // b - n // math.lcm(a, b)  # inclusion-exclusion
    code = f"n, a, b = {n}, {a}, {b}\nprint(sum(1 for k in range(1, n + 1) if k % a == 0 or k % b == 0))"
    return _Draw((n, a, b), f"How many integers from 1 to {n} are divisible by {a} or {b}?", answer, code)


def _euclid(x: int, y: int) -> int:
    while y:
        x, y = y, x % y
    return x


def _gcd(rng: random.Random, difficulty: int) -> _Draw:
    g = _pick(rng, difficulty, [(2, 20), (10, 500), (100, 10**5)])
    multipliers = [_pick(rng, difficulty, [(1, 30), (1, 1000), (1, 10**5)]) for _ in range(3)]
    x, y, z = (g * u for u in multipliers)
    code = f"import math\nnums = [{x}, {y}, {z}]\nprint(math.gcd(*nums))"
    text = f"Find the greatest common divisor of {x}, {y} and {z}."
    return _Draw((x, y, z), text, functools.reduce(_euclid, (x, y, z)), code)


def _lcm(rng: random.Random, difficulty: int) -> _Draw:
    x, y, z = (_pick(rng, difficulty, [(2, 30), (10, 500), (100, 5000)]) for _ in range(3))
    answer = functools.reduce(lambda u, v: u * v // _euclid(u, v), (x, y, z))
    code = f"import math\nnums = [{x}, {y}, {z}]\nprint(math.lcm(*nums))"
    return _Draw((x, y, z), f"Find the least common multiple of {x}, {y} and {z}.", answer, code)


def _sum_powers(rng: random.Random, difficulty: int) -> _Draw:
    p = _pick(rng, difficulty, [(2, 3), (2, 6), (3, 12)])
    n = _pick(rng, difficulty, [(10, 100), (100, 10**4), (10**4, 5 * 10**4)])
    m = _pick(rng, difficulty, [(100, 1000), (1000, 10**5), (10**5, 10**9)])
    code = f"n, p, m = {n}, {p}, {m}\nprint(sum(k ** p for k in range(1, n + 1)) % m)"
    text = f"Find the sum of k^{p} for k from 1 to {n}, modulo {m}."
    return _Draw((p, n, m), text, sum(pow(k, p, m) for k in range(1, n + 1)) % m, code)


def _lattice_paths(rng: random.Random, difficulty: int) -> _Draw:
    a, b = (_pick(rng, difficulty, [(2, 20), (10, 100), (50, 300)]) for _ in range(2))
    m = _pick(rng, difficulty, [(10, 1000), (1000, 10**5), (10**5, 10**9)])
    paths = [1] * (b + 1)  # paths[j]: paths to (i, j) mod m, row by row
    for _ in range(a):
        for j in range(1, b + 1):
            paths[j] = (paths[j] + paths[j - 1]) % m
    code = f"import math\na, b, m = {a}, {b}, {m}\nprint(math.comb(a + b, a) % m)"
    text = f"How many lattice paths go from (0, 0) to ({a}, {b}) with unit steps right or up? Answer mod {m}."
    return _Draw((a, b, m), text, paths[b], code)


def _fibonacci_mod(rng: random.Random, difficulty: int) -> _Draw:
    n = _pick(rng, difficulty, [(10, 100), (100, 10**4), (10**4, 10**6)])
    m = _pick(rng, difficulty, [(10, 1000), (1000, 10**5), (10**5, 10**9)])

    def doubling(k: int) -> tuple[int, int]:  # (F(k), F(k+1)) mod m
        if k == 0:
            return 0, 1 % m
        f, g = doubling(k // 2)
        f2, g2 = f * (2 * g - f) % m, (f * f + g * g) % m
        return (g2, (f2 + g2) % m) if k % 2 else (f2, g2)

    code = f"n, m = {n}, {m}\nx, y = 0, 1\nfor _ in range(n):\n    x, y = y, (x + y) % m\nprint(x)"
    text = f"Find F({n}) mod {m}, where F(1) = F(2) = 1 and F(k) = F(k-1) + F(k-2)."
    return _Draw((n, m), text, doubling(n)[0], code)


def _count_with_digit_sum(n: int, s: int) -> int:
    """How many integers in [1, n] have digit sum s (digit DP over the decimal digits of n)."""
    digits = [int(d) for d in str(n)]

    @functools.cache
    def count(position: int, remaining: int, tight: bool) -> int:
        if remaining < 0:
            return 0
        if position == len(digits):
            return int(remaining == 0)
        top = digits[position] if tight else 9
        return sum(count(position + 1, remaining - d, tight and d == top) for d in range(top + 1))

    return count(0, s, True) - int(s == 0)  # digit sum 0 is only the number 0, which is not counted


def _digit_sum_count(rng: random.Random, difficulty: int) -> _Draw:
    n = _pick(rng, difficulty, [(100, 999), (1000, 10**5), (10**5, 10**6)])
    s = _pick(rng, difficulty, [(2, 15), (5, 30), (10, 40)])
    code = f"n, s = {n}, {s}\nprint(sum(1 for k in range(1, n + 1) if sum(map(int, str(k))) == s))"
    text = f"How many integers from 1 to {n} have digit sum {s}?"
    return _Draw((n, s), text, _count_with_digit_sum(n, s), code)


FAMILIES: dict[str, Callable[[random.Random, int], _Draw]] = {
    "modpow": _modpow,
    "digit_sum_power": _digit_sum_power,
    "product_mod": _product_mod,
    "count_divisible": _count_divisible,
    "gcd": _gcd,
    "lcm": _lcm,
    "sum_powers": _sum_powers,
    "lattice_paths": _lattice_paths,
    "fibonacci_mod": _fibonacci_mod,
    "digit_sum_count": _digit_sum_count,
}


def _digest(family: str, params: tuple[int, ...]) -> str:
    return hashlib.sha256(f"{family}:{params}".encode()).hexdigest()


def is_heldout(problem_id: str) -> bool:
    """Whether a problem id belongs to the held-out split (a fixed ``EVAL_SHARE`` of the hash space)."""
    digest = problem_id.rsplit("-", 1)[-1]
    return int(digest, 16) < EVAL_SHARE * 16 ** len(digest)


def _generate(
    count: int, heldout: bool, rng: random.Random, families: Sequence[str], levels: Sequence[int]
) -> list[SyntheticProblem]:
    """``count`` distinct problems of one split, families and difficulties in round-robin, then shuffled."""
    problems: list[SyntheticProblem] = []
    seen: set[str] = set()
    for index in range(count):
        family = families[index % len(families)]
        difficulty = levels[(index // len(families)) % len(levels)]
        for _ in range(_MAX_DRAWS_PER_PROBLEM):
            draw = FAMILIES[family](rng, difficulty)
            problem_id = f"{family}-{_digest(family, draw.params)[:16]}"
            if problem_id not in seen and is_heldout(problem_id) == heldout:
                break
        else:
            raise ValueError(
                f"family {family!r} at difficulty {difficulty} has too few distinct problems for "
                f"{count} {'held-out' if heldout else 'train'} problems; ask for fewer or add difficulties"
            )
        seen.add(problem_id)
        problems.append(
            SyntheticProblem(problem_id, draw.problem, str(draw.answer), family, difficulty, draw.solution)
        )
    rng.shuffle(problems)
    return problems


def make_task(
    num_train: int,
    num_eval: int,
    seed: int = 0,
    families: Sequence[str] | None = None,
    difficulty: int | Sequence[int] = 1,
) -> SyntheticTask:
    """Generates disjoint train and held-out splits, deterministically from ``seed``.

    Args:
      num_train / num_eval: problems in each split (distinct within a split; families and difficulties
        are balanced round-robin, then the split is shuffled).
      seed: the same seed gives the same task.
      families: names from ``FAMILIES`` (default: all of them).
      difficulty: one level in ``DIFFICULTIES`` or a sequence of levels to mix.

    Returns:
      ``SyntheticTask(train, eval)``. The split of a problem depends only on its family and parameters,
      so train and held-out problems never overlap, even across seeds.
    """
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"num_train and num_eval must be >= 0, got {num_train} and {num_eval}")
    families = (families,) if isinstance(families, str) else tuple(FAMILIES if families is None else families)
    unknown = [f for f in families if f not in FAMILIES]
    if not families or unknown:
        raise ValueError(f"unknown or no families {unknown or families}; choose from {sorted(FAMILIES)}")
    levels = (difficulty,) if isinstance(difficulty, int) else tuple(difficulty)
    if not levels or any(level not in DIFFICULTIES for level in levels):
        raise ValueError(
            f"difficulty must be one of {DIFFICULTIES} or a sequence of them; got {difficulty!r}"
        )
    # Separate streams: the held-out split does not change when num_train changes, and vice versa.
    train = _generate(num_train, False, random.Random(f"{seed}/train"), families, levels)
    heldout = _generate(num_eval, True, random.Random(f"{seed}/eval"), families, levels)
    return SyntheticTask(train=train, eval=heldout)
