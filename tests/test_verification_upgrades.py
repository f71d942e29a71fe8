"""Exactness of block verification (chains) and traversal verification (trees), 100 000 vectorised samples.

The same first-order Markov target/draft over a 5-token vocabulary and the same production tree
builders as test_sampling_rules.py: the joint law of the first three emitted tokens must match the
target's exact law (Pearson chi-square, false-alarm rate 1e-4), deliberately broken variants must fail
it, and block verification must accept more tokens than recursive rejection sampling on the same chains.
The last tests run the option through the engine on a tiny-vocabulary Llama.
"""

import pytest
import torch
from stats_helpers import chi_square
from test_sampling_rules import N_SAMPLES, N_TOKENS, START, P, exact_law, grow_trees

from speculant.errors import SpeculantError
from speculant.trees import ChainBuilder, ConstantBranchingBuilder, IIDTreeBuilder
from speculant.verification import rules, sequence


def rrs(tokens, children, q, p, g, wor):
    return rules.recursive_rejection_sampling_batch(tokens, children, q, p, g, wor)


def block(tokens, children, q, p, g, wor):
    return sequence.block_verification_batch(tokens, children, q, p, g)


def traversal(tokens, children, q, p, g, wor):
    return sequence.traversal_verification_batch(tokens, children, q, p, g, wor)


def sample_sequences(rule, builder, without_replacement: bool, n: int, seed: int = 0) -> list[tuple]:
    """First ``N_TOKENS`` tokens of ``n`` generations, each round verified by ``rule``."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.full((n, N_TOKENS + builder.max_depth + 1), -1, dtype=torch.long)
    length = torch.zeros(n, dtype=torch.long)
    while True:
        todo = (length < N_TOKENS).nonzero()[:, 0]
        if not todo.numel():
            break
        roots = torch.where(length[todo] > 0, seqs[todo, (length[todo] - 1).clamp_min(0)], START)
        tokens, children, q = grow_trees(builder, roots, g)
        path, token = rule(tokens, children, q, P[torch.cat([roots[:, None], tokens], 1)], g, without_replacement)
        n_acc = (path >= 0).sum(1)
        emitted = torch.cat([tokens.gather(1, path.clamp_min(0)), token[:, None]], 1)
        emitted.scatter_(1, n_acc[:, None], token[:, None])
        pos = torch.arange(emitted.shape[1])
        keep = pos[None] <= n_acc[:, None]
        cols = (length[todo][:, None] + pos[None]).clamp_max(seqs.shape[1] - 1)
        seqs[todo[:, None].expand_as(cols)[keep], cols[keep]] = emitted[keep]
        length[todo] += n_acc + 1
    return [tuple(r) for r in seqs[:, :N_TOKENS].tolist()]


CASES = {
    "block-chain": (block, lambda: ChainBuilder(3), True),
    "traversal-chain": (traversal, lambda: ChainBuilder(3), True),
    "traversal-rsd-c": (traversal, lambda: ConstantBranchingBuilder([3, 2]), True),
    "traversal-specinfer": (traversal, lambda: IIDTreeBuilder([3, 2]), False),
}


@pytest.mark.parametrize("name", CASES)
def test_rule_reproduces_target_law(name):
    rule, make, wor = CASES[name]
    stat, threshold = chi_square(sample_sequences(rule, make(), wor, N_SAMPLES), exact_law())
    assert stat < threshold, (name, stat, threshold)


def unnormalised(r, q):
    """Sequence residual without the division by the rejected mass: a node is kept too rarely."""
    over = torch.clamp_min(r - q, 0.0)
    return torch.where(torch.clamp_min(q - r, 0.0).sum(-1, keepdim=True) > 0, over, r)


def token_level_residual(r, q):
    """The token-level residual (a probability): a node whose continuations were rejected is always kept."""
    return rules.residual(r, q)


@pytest.mark.parametrize("name,broken", [
    ("block-chain", unnormalised),
    ("block-chain", token_level_residual),
    ("traversal-rsd-c", unnormalised),
    ("traversal-specinfer", token_level_residual),
])
def test_broken_rule_fails_the_same_test(monkeypatch, name, broken):
    monkeypatch.setattr(sequence, "sequence_residual", broken)
    rule, make, wor = CASES[name]
    stat, threshold = chi_square(sample_sequences(rule, make(), wor, N_SAMPLES), exact_law())
    assert stat > threshold, (name, broken.__name__, stat, threshold)


def mean_accepted(rule, builder, wor, trees, seed):
    tokens, children, q, p = trees
    path, _ = rule(tokens, children, q, p, torch.Generator().manual_seed(seed), wor)
    acc = (path >= 0).sum(1).double()
    return float(acc.mean()), float(acc.std() / acc.numel() ** 0.5)


def same_trees(builder, n, seed=11):
    g = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, P.shape[0], (n,), generator=g)
    tokens, children, q = grow_trees(builder, roots, g)
    return tokens, children, q, P[torch.cat([roots[:, None], tokens], 1)]


@pytest.mark.parametrize("rule", [block, traversal])
def test_block_verification_accepts_more_than_token_level_on_the_same_chains(rule):
    """Sun et al. 2025, Thm 2: E[accepted] of block verification >= that of token-level verification.
    200 000 chains of 4 drafted tokens, verified by both rules; the gain must exceed 4 standard errors."""
    builder = ChainBuilder(4)
    trees = same_trees(builder, 200_000)
    upgraded, se_u = mean_accepted(rule, builder, True, trees, 1)
    token, se_t = mean_accepted(rrs, builder, True, trees, 2)
    assert upgraded - token > 4 * (se_u ** 2 + se_t ** 2) ** 0.5, (upgraded, token, se_u, se_t)


def test_block_verification_refuses_a_tree():
    tokens, children, q, p = same_trees(ConstantBranchingBuilder([2]), 4)
    with pytest.raises(SpeculantError, match="needs a chain"):
        sequence.block_verification_batch(tokens, children, q, p)


@pytest.mark.parametrize("verification,method,match", [
    ("block", "rsd-c", "needs a chain"), ("traversal", "rsd-s", "not exact"), ("bogus", "eagle", "unknown"),
    ("block", "ar", "drafts nothing")])
def test_bad_combinations_are_refused(verification, method, match):
    from speculant.engine.methods import MethodSpec
    with pytest.raises(SpeculantError, match=match):
        MethodSpec(method=method, verification=verification)


def test_cli_refuses_block_verification_of_a_tree_in_one_line(capsys):
    from helpers import one_line_error

    from speculant.cli import main
    code = main(["generate", "t1 t2", "--model", "/nonexistent", "--method", "rsd-c", "--verification", "block"])
    err = capsys.readouterr().err
    assert code == 2 and one_line_error(err) and "verification='block'" in err, err


# ---------------------------------------------------------------- through the engine (tiny-vocabulary Llama)

ENGINE = {
    "early-exit-block": dict(method="early-exit", exit_layer=1, num_speculations=2, verification="block"),
    "rsd-c-traversal": dict(method="rsd-c", exit_layer=1, branching="2,2", verification="traversal"),
    "specinfer-traversal": dict(method="specinfer", draft_model="truncated:1", branching="2,2",
                                verification="traversal"),
}


@pytest.fixture(scope="module")
def engine_model():
    """On the fused step where our kernels build (:func:`helpers.on_fused_step`), as test_sampling_engine.py."""
    from helpers import on_fused_step, tiny_model
    return on_fused_step(tiny_model(seed=5, scale=1.5, vocab=4, layers=2, hidden=32, heads=2, kv_heads=1, inter=64))


@pytest.mark.parametrize("name", ENGINE)
def test_engine_emits_the_target_law_with_the_option(engine_model, name):
    """5 000 seeded 3-token generations through build_generator(verification=...), as test_sampling_engine.py."""
    from stats_helpers import exact_law as model_law
    from test_sampling_engine import PROMPT, SAMPLING, sample

    from speculant import SamplingConfig
    stat, threshold = chi_square(sample(engine_model, ENGINE[name]), model_law(engine_model, PROMPT,
                                                                                SamplingConfig(**SAMPLING)))
    assert stat < threshold, (name, stat, threshold)


def test_engine_uses_the_chosen_rule(engine_model, monkeypatch):
    """The option reaches the acceptance step: a sequence residual that forgets what the draft covered (the
    token after a kept node drawn from the target itself) breaks the engine's law too."""
    from stats_helpers import exact_law as model_law
    from test_sampling_engine import PROMPT, SAMPLING, sample

    from speculant import SamplingConfig
    monkeypatch.setattr(sequence, "sequence_residual", lambda r, q: r)
    stat, threshold = chi_square(sample(engine_model, ENGINE["early-exit-block"]),
                                 model_law(engine_model, PROMPT, SamplingConfig(**SAMPLING)))
    assert stat > threshold, (stat, threshold)


@pytest.mark.parametrize("spec", [dict(method="early-exit", exit_layer=2, num_speculations=3, verification="block"),
                                  dict(method="rsd-c", exit_layer=2, branching="2,2", verification="traversal")])
def test_greedy_is_unchanged_by_the_option(spec):
    from helpers import tiny_model

    from speculant import GenerationConfig, build_generator
    model = tiny_model(seed=3, scale=2.0, vocab=64, layers=4)
    cfg = GenerationConfig(max_new_tokens=24)
    ar = build_generator(model, method="ar").generate([1, 2, 3, 4], cfg).token_ids
    assert build_generator(model, **spec).generate([1, 2, 3, 4], cfg).token_ids == ar
