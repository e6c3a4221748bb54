"""A WebShop-style shopping task: search a small catalogue, open a product, pick a size, buy.

Each episode has a catalogue of P = `num_products` products p0 .. p{P-1}, each
with a category (shirt, shoes, mug, lamp), a colour (red, blue, green, black),
a price (10, 20, 30, 40) and a non-empty set of available sizes (small,
medium, large). The instruction asks for a category, a colour, a size and a
price bound: "i want a red shirt size small under 30 .". Exactly one product,
the target, is of that category and colour, offers that size and costs less
than the bound; distractors share some attributes (about half have the
category, half the colour; any with both lacks the size or costs too much),
and at most `page_size` products share the target's category and colour, so
searching for them lists the target.

Vocabulary: the words below, p0 .. p{P-1}, EOA, PAD. Actions (A = 4), a verb,
one or two arguments, EOA:
  search W [W']  (a category and/or a colour, any order)  always works: shows
                 the results page, the first `page_size` matching products in
                 id order (exact match on the given words);
  click pK       (pK on the current results page)        opens pK's page;
  choose S       (on a product page that offers size S)   selects size S;
  buy pK         (on pK's page)                           buys pK; the episode ends.
Anything else (malformed, or a precondition fails) is invalid: the state does
not change (the turn counts), the observation starts "invalid action .",
`info["invalid"]`.
Observation (O = 3 + 10 + max(13, 6 + page_size), 26 by default; PAD after):
  [invalid action .] i want a <colour> <category> size <size> under <bound> .
then the page: "search for a product ." at the start; after a search
"results for [<colour>] [<category>] : pI pJ .. ." (or ": none ."); on a
product page "pK <colour> <category> price <price> sizes <size> .. . [chosen <size> .]".
Reward: on buy, WebShop's attribute match: (category matches + colour matches
+ chosen size is the asked one + price < bound) / 4; 1.0 iff all match. 0 on every other turn;
the episode ends on buy or after K = `max_turns` turns (the expert needs 4).
Info: "invalid", "solved" (reward 1), "bought" bool [n].
Privileged helpers (they read the hidden target): `expert_action`, `answer` (the
gold `buy p<target>`) and `optimal_distance` (turns the expert still needs).

What it stands in for: WebShop (Yao et al. 2022) — instruction following by
search, navigation, option selection and purchase, with a partial-credit
attribute reward. What it does not capture: real WebShop has 1.18M scraped
products, free-text queries to a BM25 engine, HTML pages with pagination and
descriptions, many attributes and options, and 12k human-written instructions;
here the catalogue is 8 synthetic products whose pages show every attribute,
search is exact match on two attribute words (no ranking, paging or "back"),
and the instruction is a template naming exactly the attributes the reward checks.
"""

import dataclasses

import flax
import jax
import jax.numpy as jnp

from envs import _cot, multiturn

CATEGORIES = ("shirt", "shoes", "mug", "lamp")
COLOURS = ("red", "blue", "green", "black")
SIZES = ("small", "medium", "large")
PRICES = ("10", "20", "30", "40")  # price index q costs PRICES[q]; bound b means q < b
VERBS = ("search", "click", "choose", "buy")
WORDS = ("i", "want", "a", "size", "under", ".", "invalid", "action", "for", "product",
         "results", ":", "none", "price", "sizes", "chosen")
NUM_CAT, NUM_COL, NUM_SIZE, NUM_PRICE = len(CATEGORIES), len(COLOURS), len(SIZES), len(PRICES)
START, RESULTS, PRODUCT = 0, 1, 2  # pages
_FIXED = VERBS + WORDS + CATEGORIES + COLOURS + SIZES + PRICES
_ID = {w: i for i, w in enumerate(_FIXED)}
FIRST_CAT, FIRST_COL = _ID[CATEGORIES[0]], _ID[COLOURS[0]]
FIRST_SIZE, FIRST_PRICE = _ID[SIZES[0]], _ID[PRICES[0]]
FIRST_PRODUCT = len(_FIXED)  # p0 .. p{P-1}, then EOA, PAD


@flax.struct.dataclass
class WebShopState:
  """n shopping episodes (catalogues [n, P], P = num_products).

  Attributes:
    category, colour, price: int32 [n, P]; sizes: bool [n, P, NUM_SIZE].
    target: int32 [n], the one product matching the instruction (hidden).
    goal: int32 [n, 4], the instruction: category, colour, size, price bound b (1..3).
    page: int32 [n], START, RESULTS or PRODUCT.
    query: int32 [n, 2], the search's category and colour (-1: not given; -1 -1 off RESULTS).
    item: int32 [n], the open product (-1 off PRODUCT); chosen: int32 [n], its chosen size or -1.
    invalid: bool [n], the last action was invalid (shown; not part of `state_id`).
    turn: int32 [n]; done: bool [n].
  """

  category: jax.Array
  colour: jax.Array
  price: jax.Array
  sizes: jax.Array
  target: jax.Array
  goal: jax.Array
  page: jax.Array
  query: jax.Array
  item: jax.Array
  chosen: jax.Array
  invalid: jax.Array
  turn: jax.Array
  done: jax.Array


@dataclasses.dataclass(frozen=True)
class WebShop(multiturn.MultiTurnEnv):
  """Find and buy the one product of a small catalogue that matches an instruction."""

  num_products: int = 8
  page_size: int = 3
  max_turns: int = 6

  name = "webshop"
  separator = " "

  def validate(self):
    if not (isinstance(self.num_products, int) and 2 <= self.num_products <= 16):
      raise ValueError(f"num_products must be an int in [2, 16]; got {self.num_products!r}.")
    if not (isinstance(self.page_size, int) and 1 <= self.page_size <= self.num_products):
      raise ValueError(f"page_size must be an int in [1, num_products]; got {self.page_size!r}.")
    if not (isinstance(self.max_turns, int) and self.max_turns >= 4):
      raise ValueError(f"max_turns must be an int >= 4 (the expert's plan); "
                       f"got {self.max_turns!r}.")

  @property
  def vocab(self):
    pids = tuple(f"p{k}" for k in range(self.num_products))
    return _FIXED + pids + (multiturn.EOA, multiturn.PAD)

  @property
  def obs_len(self):
    return 3 + 10 + max(13, 6 + self.page_size)

  @property
  def action_len(self):
    return 4

  def _init(self, key, n):
    p = self.num_products
    ku, kg, kt = jax.random.split(key, 3)
    u = jax.random.uniform(ku, (n, p, 8))
    g = jax.random.uniform(kg, (n, 5))
    draw = lambda x, k: jnp.minimum(jnp.floor(x * k), k - 1).astype(jnp.int32)
    c, k, s = draw(g[:, 0], NUM_CAT), draw(g[:, 1], NUM_COL), draw(g[:, 2], NUM_SIZE)
    b = 1 + draw(g[:, 3], NUM_PRICE - 1)  # under 20, 30 or 40
    target = jax.random.randint(kt, (n,), 0, p)
    is_t = jnp.arange(p) == target[:, None]  # [n, P]
    # Distractors: the goal's category / colour with probability 1/2 each, else uniform.
    cat = jnp.where(u[..., 0] < 0.5, c[:, None], draw(u[..., 1], NUM_CAT))
    col = jnp.where(u[..., 2] < 0.5, k[:, None], draw(u[..., 3], NUM_COL))
    price = draw(u[..., 4], NUM_PRICE)
    bits = draw(u[..., 5], 2**NUM_SIZE - 1) + 1  # a non-empty size set
    sizes = (bits[..., None] >> jnp.arange(NUM_SIZE)) & 1 == 1
    # At most page_size products of the goal's category and colour (the target among them).
    same = (cat == c[:, None]) & (col == k[:, None]) & ~is_t
    over = same & (jnp.cumsum(same, 1) > self.page_size - 1)
    col = jnp.where(over, (k[:, None] + 1 + draw(u[..., 6], NUM_COL - 1)) % NUM_COL, col)
    same = same & ~over
    # A distractor of the goal's category and colour lacks the size or costs too much.
    has_s = jnp.take_along_axis(sizes, s[:, None, None], 2)[..., 0]
    match = same & has_s & (price < b[:, None])
    too_dear = match & (u[..., 7] < 0.5)
    price = jnp.where(too_dear, b[:, None] + draw(u[..., 6], NUM_PRICE - b[:, None]), price)
    one_hot_s = jnp.arange(NUM_SIZE) == s[:, None, None]
    other_s = jnp.arange(NUM_SIZE) == (s[:, None, None] + 1) % NUM_SIZE
    sizes = jnp.where((match & ~too_dear)[..., None], (sizes | other_s) & ~one_hot_s, sizes)
    # The target: the goal's category and colour, the size among its sizes, under the bound.
    cat = jnp.where(is_t, c[:, None], cat)
    col = jnp.where(is_t, k[:, None], col)
    price = jnp.where(is_t, draw(g[:, 4], b)[:, None], price)
    sizes = jnp.where(is_t[..., None], sizes | one_hot_s, sizes)
    z, m1 = jnp.zeros((n,), jnp.int32), jnp.full((n,), -1, jnp.int32)
    return WebShopState(category=cat.astype(jnp.int32), colour=col.astype(jnp.int32),
                        price=price.astype(jnp.int32), sizes=sizes, target=target.astype(jnp.int32),
                        goal=jnp.stack([c, k, s, b], 1).astype(jnp.int32), page=z + START,
                        query=jnp.full((n, 2), -1, jnp.int32), item=m1, chosen=m1,
                        invalid=jnp.zeros((n,), bool), turn=z, done=jnp.zeros((n,), bool))

  def _results(self, s, query):
    """One episode's results for a query [2]: (product ids [page_size], count, shown bool [P])."""
    match = ((query[0] < 0) | (s.category == query[0])) & ((query[1] < 0) | (s.colour == query[1]))
    shown = match & (jnp.cumsum(match) <= self.page_size)
    order = jnp.argsort(~shown, stable=True)[:self.page_size]
    return order.astype(jnp.int32), jnp.sum(shown), shown

  def _act(self, s, tokens, mask):
    """One episode's action (tokens, mask [A]): (next state, reward, bought, valid)."""
    tok = jnp.where(mask, tokens, -1)
    verb, a1, a2 = tok[0], tok[1], tok[2]
    short = tok[2] == self.eoa_id  # verb, one argument, EOA
    long = (tok[3] == self.eoa_id) & ~short  # verb, two arguments, EOA
    arg_cat = lambda a: jnp.where((a >= FIRST_CAT) & (a < FIRST_CAT + NUM_CAT), a - FIRST_CAT, -1)
    arg_col = lambda a: jnp.where((a >= FIRST_COL) & (a < FIRST_COL + NUM_COL), a - FIRST_COL, -1)
    pid = a1 - FIRST_PRODUCT
    is_pid = short & (pid >= 0) & (pid < self.num_products)
    pid = jnp.clip(pid, 0, self.num_products - 1)
    size = a1 - FIRST_SIZE
    is_size = short & (size >= 0) & (size < NUM_SIZE)
    size = jnp.clip(size, 0, NUM_SIZE - 1)
    # search: one word (a category or a colour), or one of each in either order.
    c1, k1, c2, k2 = arg_cat(a1), arg_col(a1), arg_cat(a2), arg_col(a2)
    query = jnp.where(short, jnp.stack([c1, k1]),
                      jnp.stack([jnp.maximum(c1, c2), jnp.maximum(k1, k2)]))
    ok_long = ((c1 >= 0) & (k2 >= 0)) | ((k1 >= 0) & (c2 >= 0))
    search = (verb == _ID["search"]) & ((short & ((c1 >= 0) | (k1 >= 0))) | (long & ok_long))
    listed = self._results(s, s.query)[2][pid]
    click = (verb == _ID["click"]) & is_pid & (s.page == RESULTS) & listed
    choose = (verb == _ID["choose"]) & is_size & (s.page == PRODUCT) & s.sizes[s.item, size]
    buy = (verb == _ID["buy"]) & is_pid & (s.page == PRODUCT) & (s.item == pid)
    m1 = jnp.int32(-1)
    nxt = s.replace(
        page=jnp.where(search, RESULTS, jnp.where(click, PRODUCT, s.page)).astype(jnp.int32),
        query=jnp.where(search, query, jnp.where(click, -1, s.query)).astype(jnp.int32),
        item=jnp.where(search, m1, jnp.where(click, pid, s.item)).astype(jnp.int32),
        chosen=jnp.where(search | click, m1, jnp.where(choose, size, s.chosen)).astype(jnp.int32))
    valid = search | click | choose | buy
    return nxt.replace(invalid=~valid), jnp.where(buy, self._match(s, pid), 0.0), buy, valid

  def _match(self, s, k):
    """The attribute-match reward of buying product k with size s.chosen (one episode)."""
    hits = jnp.stack([s.category[k] == s.goal[0], s.colour[k] == s.goal[1],
                      s.chosen == s.goal[2], s.price[k] < s.goal[3]])
    return jnp.mean(hits.astype(jnp.float32))

  def _transition(self, state, actions, action_mask):
    nxt, reward, bought, valid = jax.vmap(self._act)(state, actions, action_mask)
    info = {"invalid": ~valid, "solved": reward == 1.0, "bought": bought}
    return nxt, reward.astype(jnp.float32), bought, info

  def _observe1(self, s):
    """One episode's observation: int32 [O], length."""
    ids = lambda words: jnp.asarray([_ID[w] for w in words], jnp.int32)
    piece = lambda words, keep=True: (ids(words), jnp.where(keep, len(words), 0))
    one = lambda tok, keep=True: (jnp.stack([tok]).astype(jnp.int32), jnp.where(keep, 1, 0))
    at = lambda x, i: x[jnp.clip(i, 0, self.num_products - 1)]
    g = s.goal
    res, count, _ = self._results(s, s.query)
    on_res, on_prod = s.page == RESULTS, s.page == PRODUCT
    k = s.item
    return _cot.concat([
        piece(("invalid", "action", "."), s.invalid),
        (jnp.stack([_ID["i"], _ID["want"], _ID["a"], FIRST_COL + g[1], FIRST_CAT + g[0],
                    _ID["size"], FIRST_SIZE + g[2], _ID["under"], FIRST_PRICE + g[3],
                    _ID["."]]), 10),
        piece(("search", "for", "a", "product", "."), s.page == START),
        piece(("results", "for"), on_res),
        one(FIRST_COL + s.query[1], on_res & (s.query[1] >= 0)),
        one(FIRST_CAT + s.query[0], on_res & (s.query[0] >= 0)),
        piece((":",), on_res),
        (FIRST_PRODUCT + res, jnp.where(on_res, count, 0)),
        piece(("none",), on_res & (count == 0)),
        piece((".",), on_res),
        (jnp.stack([FIRST_PRODUCT + k, FIRST_COL + at(s.colour, k), FIRST_CAT + at(s.category, k),
                    _ID["price"], FIRST_PRICE + at(s.price, k), _ID["sizes"]]),
         jnp.where(on_prod, 6, 0)),
        (FIRST_SIZE + jnp.argsort(~at(s.sizes, k), stable=True),
         jnp.where(on_prod, jnp.sum(at(s.sizes, k)), 0)),
        piece((".",), on_prod),
        (jnp.stack([_ID["chosen"], FIRST_SIZE + s.chosen, _ID["."]]),
         jnp.where(on_prod & (s.chosen >= 0), 3, 0)),
    ], self.obs_len, self.pad_id)

  def observe(self, state):
    """The text observation int32 [n, O] (PAD after it) and its mask."""
    obs, length = jax.vmap(self._observe1)(state)
    return obs, jnp.arange(self.obs_len) < length[:, None]

  def _state_arrays(self, state):
    # The world state: the last action's feedback (`invalid`) is left out of the id.
    return [state.category, state.colour, state.price, state.sizes, state.target, state.goal,
            state.page, state.query, state.item, state.chosen]

  # --- the privileged expert ----------------------------------------------------------------------

  def optimal_distance(self, state):
    """int32 [n]: turns a shortest plan to reward 1 still needs (0 when done): 1 on the target's
    page with the goal size chosen, 2 on it otherwise, 3 on results listing it, else 4."""
    on_target = (state.page == PRODUCT) & (state.item == state.target)
    listed = jax.vmap(lambda s: self._results(s, s.query)[2][s.target])(state)
    d = jnp.where(on_target, jnp.where(state.chosen == state.goal[:, 2], 1, 2),
                  jnp.where((state.page == RESULTS) & listed, 3, 4))
    return jnp.where(state.done, 0, d).astype(jnp.int32)

  def answer(self, state):
    """The gold final action `buy p<target>`: int32 [n, A], bool [n, A]."""
    n = state.target.shape[0]
    col = lambda x: jnp.full((n,), x, jnp.int32)
    actions = jnp.stack([col(_ID["buy"]), FIRST_PRODUCT + state.target, col(self.eoa_id),
                         col(self.pad_id)], 1).astype(jnp.int32)
    return actions, jnp.broadcast_to(jnp.arange(self.action_len) < 3, actions.shape)

  def expert_action(self, state):
    """The next action of a shortest plan to reward 1 (int32 [n, A], bool [n, A]): search the
    goal's colour and category, click the target, choose the goal size, buy (done: buy)."""
    d = self.optimal_distance(state)
    g, pid, four = state.goal, FIRST_PRODUCT + state.target, d == 4
    verb = jnp.asarray([_ID["buy"], _ID["buy"], _ID["choose"], _ID["click"], _ID["search"]])[d]
    a1 = jnp.select([four, d == 2], [FIRST_COL + g[:, 1], FIRST_SIZE + g[:, 2]], pid)
    actions = jnp.stack([verb, a1, jnp.where(four, FIRST_CAT + g[:, 0], self.eoa_id),
                         jnp.where(four, self.eoa_id, self.pad_id)], 1).astype(jnp.int32)
    return actions, jnp.arange(self.action_len) < jnp.where(four, 4, 3)[:, None]
