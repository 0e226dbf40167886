"""Tree verification of block drafts (DDTree, arXiv 2604.12989): verify many continuations in one target forward.

A block drafter's one forward gives a distribution ``q_d`` at every draft depth ``d``, and none of them depends on the
tokens drafted before it (the block is drafted in parallel). Verifying only the top-1 path throws the rest away. A
*draft tree* keeps the most probable continuations instead: a node at depth ``d`` with token ``x`` scores
``sum_{i<=d} log q_i(x_i)`` along its path, and the tree holds the ``budget - 1`` best-scoring nodes (best-first, as
DDTree builds it: popping a node pushes its first child and its next sibling, so nodes come out in non-increasing
score and every parent comes before its children). The anchor is the root, so a budget of ``n`` verifies ``n``
tokens, as a linear candidate of length ``n`` does, and a budget of 1 is a plain decoding step.

The target verifies ``[anchor, nodes...]`` in one forward, each node at position ``anchor + depth`` under a 4D
attention mask that lets it see the committed cache and its own ancestors only, so each node's logits are exactly the
target's logits after the node's path. A tree that is one path (`DraftTree.is_chain`) is a linear block, and the
causal mask gives it the same visibility.

Why acceptance stays exact (greedy and sampling): at the root, the loop takes the token ``t`` the target chooses from
its processed logits there (argmax, or one sample); if a child of the root carries ``t``, it moves to that child and
repeats, otherwise it stops and ``t`` is the step's bonus token. Every token committed is thus the target's own
choice after exactly the committed prefix: greedy output is plain greedy output, and each sampled token is a fresh
sample from the target's processed distribution given its prefix, so the joint distribution is plain sampling's.
The tree only decides how far one forward can go. (This is the recursive rejection sampling of SpecInfer/Sequoia
for drafts that are deterministic: a candidate ``c`` with draft probability one is accepted with probability
``p(c)`` and, when rejected, leaves the residual ``p`` with ``c`` removed; trying a node's children in turn accepts
child ``c`` with probability ``p(c)`` and stops with a token outside the children otherwise, which is exactly what
"sample from ``p``, descend if it is a child" does.)

**Merged n-gram paths** (``adaflash_ngram``, `ngram.py`): the continuations the row's own context offers are
added as paths of the same tree before the drafter's nodes, a prefix the two share stored once (a node's children
carry distinct tokens, whoever proposed them), and the drafter's best-first nodes fill the rest of the budget. The
argument above never used where a node came from: it needs a tree fixed before the target's choices are drawn, with
distinct tokens among siblings and parents before children. The n-gram paths are a function of the committed tokens
only (deterministic proposals), and how many of their tokens a step takes (the plan's choice) depends only on earlier
steps and their timings, so the merged tree is fixed before this step's draws, and the walk commits exactly the
target's own choices whichever source proposed the path it follows; greedy output stays plain greedy output and
sampled output keeps plain sampling's distribution.

`TreeVerifier` is the loop's verifier for trees (the linear one is `verifiers.LinearVerifier`): it builds each row's
tree, verifies it in one forward, walks it, and moves the accepted path's cache columns, features and logits to the
front of the step's, so that the loop commits it exactly as a linear block.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from .acceptance import leading_true
from .verifiers import History, TargetForward, Verified


@dataclass
class DraftTree:
    """Draft trees of a batch, node ``0`` of each row being its anchor (not stored).

    tokens ``[B, N]``: the token of node ``i + 1`` (padding where not ``valid``).
    parents ``[B, N]``: the index in ``[0, N]`` of node ``i + 1``'s parent (``0``: the anchor; padding points there).
    depths ``[B, N]``: node ``i + 1``'s depth (1 for the anchor's children; padding has depth 1).
    valid ``[B, N]``: real nodes; a row's real nodes come first.
    sources ``[B, N]``: who proposed each node, bits `DRAFTER` and `PATHS` (both: a node the two share; 0: padding).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    valid: torch.Tensor
    sources: torch.LongTensor | None = None

    @property
    def width(self) -> int:
        """Tokens verified per row: the anchor and ``N`` nodes."""
        return self.tokens.shape[1] + 1

    @property
    def num_nodes(self) -> torch.LongTensor:
        return self.valid.sum(-1)

    @property
    def deepest(self) -> torch.LongTensor:
        """``[B]``: the depth of each row's deepest node (0 for a row without nodes)."""
        return (self.depths * self.valid).amax(-1) if self.valid.numel() else self.num_nodes

    @property
    def is_chain(self) -> bool:
        """Whether every row's nodes form one path from the anchor in node order (node ``i + 1``'s parent is node
        ``i``): a linear block, which the causal mask verifies and whose walk order is the node order."""
        previous = torch.arange(self.tokens.shape[1], device=self.parents.device)
        return bool(((self.parents == previous) | ~self.valid).all())

    def ancestry(self) -> torch.Tensor:
        """``[B, N + 1, N + 1]`` bool: ``[b, i, j]`` is True when node ``j`` is node ``i`` or one of its ancestors
        (the visibility of a tree attention mask). Parents come before children, so one pass in node order fills it."""
        batch, width = self.tokens.shape[0], self.width
        seen = torch.zeros(batch, width, width, dtype=torch.bool, device=self.tokens.device)
        seen[:, 0, 0] = True
        rows = torch.arange(batch, device=self.tokens.device)
        for i in range(1, width):
            seen[:, i] = seen[rows, self.parents[:, i - 1]]
            seen[:, i, i] = True
        return seen


DRAFTER, PATHS = 1, 2  # `DraftTree.sources` bits: a node of the drafter's best-first tree, of a merged path


class _RowTree:
    """One row's tree under construction: nodes ``(token, parent, depth, sources)`` in insertion order (parents
    first), at most `nodes` of them, a node's children carrying distinct tokens."""

    def __init__(self, nodes: int):
        self.nodes, self.capacity = [], nodes
        self.children: dict[tuple[int, int], int] = {}

    @property
    def full(self) -> bool:
        return len(self.nodes) >= self.capacity

    def add(self, token: int, parent: int, source: int) -> int | None:
        """The index of ``parent``'s child carrying ``token``, added when new (``None``: no room for it)."""
        index = self.children.get((parent, token))
        if index is not None:
            token_, parent_, depth, sources = self.nodes[index - 1]
            self.nodes[index - 1] = (token_, parent_, depth, sources | source)
            return index
        if self.full:
            return None
        depth = 1 if parent == 0 else self.nodes[parent - 1][2] + 1
        self.nodes.append((token, parent, depth, source))
        self.children[(parent, token)] = index = len(self.nodes)
        return index

    def add_paths(self, paths: list[list[int]], nodes: int) -> None:
        """Adds `paths` from the anchor, in order, until `nodes` of this tree's nodes are theirs."""
        limit = min(self.capacity, len(self.nodes) + nodes)
        for path in paths:
            parent = 0
            for token in path:
                if (parent, token) not in self.children and len(self.nodes) >= limit:
                    return
                parent = self.add(token, parent, PATHS)


def build_trees(
    logits: torch.Tensor | None,
    max_depth: torch.LongTensor,
    budget: int,
    pad_token_id: int = 0,
    paths: list[list[list[int]]] | None = None,
    path_nodes: int = 0,
) -> DraftTree:
    """Best-first draft trees from the drafter's per-depth logits, with extra paths merged in.

    Args:
        logits (`torch.Tensor` of shape `(batch_size, depth, vocab_size)`, *optional*):
            The drafter's processed logits for draft depths ``1..depth`` (the same processors as the target's);
            ``None``: the drafter did not run, the trees hold `paths` only.
        max_depth (`torch.LongTensor` of shape `(batch_size,)`):
            The deepest node of the drafter each row may hold (the length policy's drafts, capped by the token
            budget); ``0`` gives a row no drafter nodes.
        budget (`int`):
            Tokens verified per row, anchor included: each row holds at most ``budget - 1`` nodes.
        pad_token_id (`int`):
            The token padding nodes carry (they are masked; any id works).
        paths (`list[list[list[int]]]`, *optional*):
            Per row, token paths from the anchor (n-gram continuations, `ngram.py`), placed before the drafter's
            nodes, at most `path_nodes` nodes of them; the drafter's nodes fill the rest of the budget, a node both
            propose counting once.
    """
    batch = max_depth.shape[0]
    nodes = budget - 1
    device = max_depth.device if logits is None else logits.device
    trees = [_RowTree(max(nodes, 0)) for _ in range(batch)]
    for tree, row_paths in zip(trees, paths or ()):
        tree.add_paths(row_paths, path_nodes)
    if logits is not None and nodes > 0:
        # a depth where the processors allow no token ends the row's tree: nothing there can be proposed
        allowed = leading_true(logits.amax(-1) > float("-inf"))
        depth_cap = torch.minimum(max_depth.clamp(max=logits.shape[1]), allowed).tolist()
        if max(depth_cap, default=0) > 0:
            # a node's children at depth d are the top tokens of q_d in order; no tree uses more than `nodes`
            per_depth = min(nodes, logits.shape[-1])
            scores, ids = torch.log_softmax(logits.float(), dim=-1).topk(per_depth, dim=-1)
            scores, ids = scores.tolist(), ids.tolist()
            for b, tree in enumerate(trees):
                _best_first(scores[b], ids[b], depth_cap[b], tree)
    size = max((len(tree.nodes) for tree in trees), default=0)
    tokens = torch.full((batch, size), pad_token_id, dtype=torch.long)
    parents = torch.zeros(batch, size, dtype=torch.long)
    depths = torch.ones(batch, size, dtype=torch.long)
    sources = torch.zeros(batch, size, dtype=torch.long)
    valid = torch.zeros(batch, size, dtype=torch.bool)
    for b, tree in enumerate(trees):
        if tree.nodes:
            count = len(tree.nodes)
            tokens[b, :count], parents[b, :count], depths[b, :count], sources[b, :count] = torch.tensor(tree.nodes).T
            valid[b, :count] = True
    return DraftTree(tokens.to(device), parents.to(device), depths.to(device), valid.to(device), sources.to(device))


def _best_first(scores: list[list[float]], ids: list[list[int]], max_depth: int, tree: _RowTree) -> None:
    """Adds the drafter's nodes to one row's tree in pop order (parents first) until it is full.

    A heap entry is a node not yet in the tree: ``(-score, depth, rank, parent)``; `rank` is the token's rank in
    ``q_depth``. Popping it pushes its first child (rank 0 one level deeper) and its next sibling (rank + 1 under the
    same parent), the only nodes whose best unexplored score it bounds. A popped node the tree already holds (a
    merged path proposed it too) costs no room.
    """
    if max_depth <= 0:
        return
    heap = [(-scores[0][0], 1, 0, 0)]
    width = len(ids[0])
    while heap and not tree.full:
        negative, depth, rank, parent = heapq.heappop(heap)
        index = tree.add(ids[depth - 1][rank], parent, DRAFTER)
        if depth < max_depth:
            heapq.heappush(heap, (negative - scores[depth][0], depth + 1, 0, index))
        if rank + 1 < width and scores[depth - 1][rank + 1] > float("-inf"):  # a banned token is never drafted
            sibling = negative + scores[depth - 1][rank] - scores[depth - 1][rank + 1]
            heapq.heappush(heap, (sibling, depth, rank + 1, parent))


def tree_attention_mask(
    tree: DraftTree, past: torch.Tensor | None, past_length: int, dtype: torch.dtype
) -> torch.Tensor:
    """The ``[B, 1, N + 1, past_length + N + 1]`` additive mask of one tree verification.

    Each verified token sees the cache columns ``past`` marks valid (``[B, past_length]`` bool, ``None``: all) and
    its own ancestors and itself. Additive (0 or the dtype's minimum), since eager attention adds the mask to the
    scores while SDPA takes either form; transformers passes a 4D mask through unchanged.
    """
    seen = tree.ancestry()
    batch, width = seen.shape[:2]
    seen[:, :, 1:] &= tree.valid[
        :, None, :
    ]  # padding nodes are nobody's ancestor (they see the anchor and themselves)
    if past is None:
        past = torch.ones(batch, past_length, dtype=torch.bool, device=seen.device)
    visible = torch.cat([past[:, None, :].expand(-1, width, -1), seen], dim=-1)
    return torch.zeros(visible.shape, dtype=dtype, device=seen.device).masked_fill(~visible, torch.finfo(dtype).min)[
        :, None
    ]


def walk_trees(
    tree: DraftTree, choices: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
    """Follows the target's choices down each row's tree.

    choices ``[B, N + 1]``: the target's token at every verified position (argmax or one sample of its processed
    distribution there). Returns ``(accepted [B], order [B, N + 1], following [B])``: the number of nodes on the
    accepted path, the verified positions reordered as anchor, accepted path, then the rest (so the accepted
    prefix of the reorder is what a linear verification would have committed), and the bonus token.
    """
    batch, width = choices.shape
    choice_list = choices.tolist()
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    accepted, orders, following = [], [], []
    for b in range(batch):
        children = {
            (parents[b][i], tokens[b][i]): i + 1 for i in range(width - 1) if valid[b][i]
        }  # tokens are unique among siblings: each comes from a different rank of one distribution
        path, node = [], 0
        while (child := children.get((node, choice_list[b][node]))) is not None:
            path.append(child)
            node = child
        on_path = set(path)
        accepted.append(len(path))
        following.append(choice_list[b][node])
        orders.append([0, *path, *(i for i in range(1, width) if i not in on_path)])
    device = choices.device
    return (
        torch.tensor(accepted, device=device),
        torch.tensor(orders, device=device),
        torch.tensor(following, device=device),
    )


class TreeVerifier:
    """Verifies a draft tree per row (module docstring).

    Args:
        forward (`TargetForward`): the target's verification forward.
        choose: the target's token from processed logits (argmax, or one sample).
        budget (`int`): ``adaflash_tree_budget``, tokens per row and step, anchor included.
        pad_token_id (`int`): tree padding, and what a stopped row gets.
        mask_dtype (`torch.dtype`): the target's dtype (tree masks are additive).
    """

    def __init__(self, forward: TargetForward, choose, budget: int, pad_token_id: int, mask_dtype: torch.dtype):
        self.forward, self.choose, self.budget = forward, choose, budget
        self.pad_token_id, self.mask_dtype = pad_token_id, mask_dtype

    def verify(
        self, anchors, drafts, positions, history: History, padded, depth, budget: int, paths=None, path_nodes=0
    ) -> Verified:
        """As `verifiers.LinearVerifier.verify`, with each row's tree at most ``depth [B]`` deep (the drafter's
        nodes) and ``budget`` tokens wide, and each row's `paths` merged in, at most `path_nodes` nodes of them
        (`build_trees`; ``drafts.logits`` is ``None`` when the drafter did not run)."""
        if padded is not None:  # plain decoding only pads a stopped row: it gets no tree, its token is padding
            depth = depth.masked_fill(padded, 0)
            if paths is not None:
                paths = [[] if stopped else row for row, stopped in zip(paths, padded.tolist())]
        tree = build_trees(drafts.logits, depth, budget, self.pad_token_id, paths, path_nodes)
        cache = self.forward.cache
        width, past = tree.width, cache.columns
        ids = torch.cat([anchors[:, None], tree.tokens], dim=1)
        depths = torch.cat([tree.depths.new_zeros(len(anchors), 1), tree.depths], 1)
        # Most merged trees are one path (a copied path the drafter agrees with, a confident drafter): verified as
        # the linear block it is, under the causal mask, which lets attention keep its fast kernels (a 4D mask costs
        # a copy of every layer's keys and values for grouped heads), and with nothing to reorder after the walk.
        chain = tree.is_chain
        if chain:
            mask = cache.extended_mask(torch.cat([tree.valid.new_ones(len(anchors), 1), tree.valid], 1))
        else:
            mask = tree_attention_mask(tree, cache.mask, past, self.mask_dtype)
        # ids-independent processors only (checked before the call runs), so no node needs its path as their ids
        positions = positions[:, None] + depths
        raw, processed, features, trial, at = self.forward(ids, mask, positions, tree.tokens, history)
        choices = self.choose(processed.flatten(0, 1)).view(processed.shape[:2])
        accepted, order, following = walk_trees(tree, choices)
        if padded is not None:
            following = following.masked_fill(padded, self.pad_token_id)

        def by_order(values):  # [B, width, ...] in the walk's order: anchor, accepted path, the rest
            if chain:  # the accepted path is the chain's prefix: the walk's order is the node order
                return values
            return values.gather(1, order.view(*order.shape, *[1] * (values.dim() - 2)).expand_as(values))

        if not chain:
            cache.move_to_front(order, width)
        path = by_order(ids)[:, 1:]
        committed = torch.cat([path, following[:, None]], dim=1).scatter(1, accepted[:, None], following[:, None])
        by_source = None
        if paths is not None:
            # each source's share of the step: the accepted path's leading nodes it proposed, and its deepest node
            on_path = torch.arange(width - 1, device=accepted.device) < accepted[:, None]
            path_sources = by_order(torch.cat([tree.sources.new_zeros(len(anchors), 1), tree.sources], 1))[:, 1:]
            by_source = {
                name: (
                    leading_true((path_sources & bit).ne(0) & on_path),
                    (tree.depths * (tree.sources & bit).ne(0)).amax(-1) if width > 1 else accepted,
                )
                for name, bit in (("drafter", DRAFTER), ("ngram", PATHS))
            }
        return Verified(
            committed,
            accepted,
            tree.num_nodes,
            tree.deepest,
            by_order(processed),
            by_order(raw),
            width,
            by_order(features),
            trial,
            at,
            by_source,
        )
