"""Counters of one generation: speed, acceptance, work done."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """What one ``generate`` call did.

    Attributes (units in brackets):
        new_tokens: tokens emitted [tokens].
        seconds: wall time from the start of prefill to the last token [s].
        time_to_first_token_s: prefill + first token [s].
        target_forwards: target calls, prefill included.
        draft_forwards: draft network calls (one per tree depth).
        drafted_tokens: tree nodes proposed [tokens].
        accepted_tokens: drafted tokens accepted by the rule [tokens].
        rounds: verification rounds (target forwards after prefill).
        accepted_at_depth / drafted_at_depth: per-position acceptance counts
            (index d-1 = depth d): rounds whose tree reached depth d, and those
            that accepted a token at depth d.
        layer_token_evaluations: per target layer, tokens it processed.
        tree_nodes_max: largest tree verified [tokens].
        speculated_rounds / ar_rounds: rounds that verified at least one drafted token / none (an ``ar`` round:
            nothing drafted, chosen by ``--speculation cost`` or with nothing to draft) [count].
        draft_seconds: time spent in the drafter's ``draft`` calls [s].
        first_draft_seconds: the part of ``draft_seconds`` spent on the rounds' first depth (a model drafter's
            first draft forward of the round, which also runs the entries committed since its last one) [s].
        accept_seconds: time spent accepting and committing the rounds' blocks [s].
        rounds_by_context: for a drafter that drafts in several round contexts (prompt lookup: per matched n-gram
            size; ``eagle-lookup``: copying rounds and head rounds), per context name
            (:meth:`~speculant.drafters.base.Drafter.context_name`) ``{"rounds", "speculated_rounds",
            "drafted_tokens", "accepted_tokens"}`` [count, tokens]; rounds with no room to draft are not counted.
    """

    new_tokens: int = 0
    seconds: float = 0.0
    time_to_first_token_s: float = 0.0
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)
    drafted_at_depth: list[int] = field(default_factory=list)
    layer_token_evaluations: list[int] = field(default_factory=list)
    tree_nodes_max: int = 0
    speculated_rounds: int = 0
    ar_rounds: int = 0
    draft_seconds: float = 0.0
    first_draft_seconds: float = 0.0
    accept_seconds: float = 0.0
    rounds_by_context: dict = field(default_factory=dict)

    def record_round(self, tree_size: int, tree_depth: int, accepted: int) -> None:
        self._last_accepted = accepted
        self.rounds += 1
        if tree_size:
            self.speculated_rounds += 1
        else:
            self.ar_rounds += 1
        self.drafted_tokens += tree_size
        self.accepted_tokens += accepted
        self.tree_nodes_max = max(self.tree_nodes_max, tree_size)
        while len(self.drafted_at_depth) < tree_depth:
            self.drafted_at_depth.append(0)
            self.accepted_at_depth.append(0)
        for d in range(tree_depth):
            self.drafted_at_depth[d] += 1
            self.accepted_at_depth[d] += int(d < accepted)

    def record_context(self, name: str, tree_size: int, accepted: int) -> None:
        """The round just recorded was drafted in the round context named ``name`` (see ``rounds_by_context``)."""
        c = self.rounds_by_context.setdefault(name, {"rounds": 0, "speculated_rounds": 0, "drafted_tokens": 0,
                                                     "accepted_tokens": 0})
        c["rounds"] += 1
        c["speculated_rounds"] += int(tree_size > 0)
        c["drafted_tokens"] += tree_size
        c["accepted_tokens"] += accepted

    def cut_last_round(self, kept: int) -> None:
        """The last round's block was cut after ``kept`` tokens (a stop string): its accepted drafted tokens
        past the cut were never emitted, so they leave the acceptance counters (as at an EOS cut)."""
        accepted = getattr(self, "_last_accepted", 0)
        if kept >= accepted:
            return
        self.accepted_tokens -= accepted - kept
        for d in range(kept, accepted):
            self.accepted_at_depth[d] -= 1
        self._last_accepted = kept

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (for trees: per node, so at most 1/branching)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafted tokens accepted per verification round [tokens]."""
        return self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_tree_nodes(self) -> float:
        """Drafted nodes verified per target call: the target budget actually used [tokens]."""
        return self.drafted_tokens / self.rounds if self.rounds else 0.0

    @property
    def block_efficiency(self) -> float:
        """Emitted tokens per target forward, tau (Leviathan et al. 2023, Sec. 3.1); 1.0 for AR."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at_depth, self.drafted_at_depth)]

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("tokens_per_second", "acceptance_rate", "mean_accepted_length", "mean_tree_nodes", "block_efficiency",
                  "acceptance_by_position"):
            d[k] = getattr(self, k)
        return d
