// Suffix decoding's depth-bounded suffix trie (mechserve/executor/proposers_suffix.py), natively: the same
// algorithm as the Python ``SuffixTree``/``Cursor``/``Matcher``/``best_draft`` (the reference this is tested
// against), step for step, so node ids, counts, ties and drafts come out identical; only the cost differs
// (one foreign call per id appended instead of up to max_depth dict and array updates in the interpreter).
//
// A node is an int64 id (0: the root, the empty substring) indexing a vector of Node records (struct Node:
// count, out, best, token, the chain of its parent's children, how many children it has).  A child is
// found by walking its parent's chain while the parent has few children (at most kChainMax: almost every
// node; where text does not repeat itself each id appended makes max_depth - 1 new nodes of one child or
// none), and in one open-addressing hash map keyed by (parent << 32) | token once the parent has more
// (the root, frequent ids).  So a new node costs no hash map insertion, which measured about half of an
// append's time (a cache miss each in a map of millions of entries), and its fields are one cache line.
// The map probes linearly and deletes by backward shift (no tombstones, so a tree that adds and removes
// forever keeps its probe lengths); a parent back down to kChainMax / 2 children takes them out again.
// Dropped node ids are reused last-freed first, before ids never used, exactly as the Python tree does.
//
// The caller owns the cursors' and matchers' state (int64 buffers, see each function); the tree owns
// everything else and is freed by mechserve_suffix_tree_destroy.  Every function returns an error code
// instead of throwing (an exception must not cross the C ABI); nothing here is thread-safe (the Python
// side calls it holding the GIL, through ctypes.PyDLL).
//
// Floating point: a draft's score is prob *= count / out; score += prob in double, in the Python order,
// built with -ffp-contract=off so that no multiply-add is fused: scores are bit-identical to Python's.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr int64_t kMaxToken = (int64_t(1) << 32) - 1;
constexpr int64_t kChainMax = 8;  // a node with more children than this finds them in the hash map
constexpr int64_t kHashed = int64_t(1) << 62;  // in Node::kids: the children are in the hash map
constexpr uint64_t kEmpty = ~uint64_t(0);
std::atomic<int64_t> live_trees{0};  // trees made and not yet destroyed (tests check that memory is given back)

// Edges: key (parent << 32) | token -> child node id.  Power-of-two capacity, at most half full.
struct EdgeMap {
    std::vector<uint64_t> keys;
    std::vector<int64_t> vals;
    size_t mask = 0;
    size_t size = 0;

    EdgeMap() { reset(64); }

    void reset(size_t capacity) {
        keys.assign(capacity, kEmpty);
        vals.assign(capacity, -1);
        mask = capacity - 1;
        size = 0;
    }

    static size_t hash(uint64_t k) {  // murmur3's finaliser: parents and tokens both spread over every bit
        k ^= k >> 33;
        k *= 0xff51afd7ed558ccdULL;
        k ^= k >> 33;
        k *= 0xc4ceb9fe1a85ec53ULL;
        k ^= k >> 33;
        return static_cast<size_t>(k);
    }

    int64_t get(uint64_t k) const {
        for (size_t i = hash(k) & mask;; i = (i + 1) & mask) {
            if (keys[i] == k) return vals[i];
            if (keys[i] == kEmpty) return -1;
        }
    }

    void put(uint64_t k, int64_t v) {  // k is not in the map (the caller looked it up)
        if ((size + 1) * 2 > keys.size()) grow();
        size_t i = hash(k) & mask;
        while (keys[i] != kEmpty) i = (i + 1) & mask;
        keys[i] = k;
        vals[i] = v;
        ++size;
    }

    void erase(uint64_t k) {
        size_t i = hash(k) & mask;
        while (keys[i] != k) {
            if (keys[i] == kEmpty) return;
            i = (i + 1) & mask;
        }
        // backward shift: move each later entry of the run into the hole unless its home lies after the hole
        for (size_t j = (i + 1) & mask; keys[j] != kEmpty; j = (j + 1) & mask) {
            size_t home = hash(keys[j]) & mask;
            bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
            if (!stays) {
                keys[i] = keys[j];
                vals[i] = vals[j];
                i = j;
            }
        }
        keys[i] = kEmpty;
        vals[i] = -1;
        --size;
    }

    void grow() {
        std::vector<uint64_t> old_keys;
        std::vector<int64_t> old_vals;
        old_keys.swap(keys);
        old_vals.swap(vals);
        reset(old_keys.size() * 2);
        for (size_t i = 0; i < old_keys.size(); ++i) {
            if (old_keys[i] == kEmpty) continue;
            size_t j = hash(old_keys[i]) & mask;
            while (keys[j] != kEmpty) j = (j + 1) & mask;
            keys[j] = old_keys[i];
            vals[j] = old_vals[i];
            ++size;
        }
    }
};

// A node's fields, one cache line: a new node (what every id appended makes, max_depth - 1 of them, where text
// does not repeat itself) is written in one line instead of one per field.
struct Node {
    int64_t count = 0;   // how often its substring occurred
    int64_t out = 0;     // how often an id followed it: its children's counts summed
    int64_t best = -1;   // its most frequent child (ties: the smaller token id), -1 without children
    int64_t token = -1;  // the token id on the edge into it
    int64_t first = -1;  // its first child, then along next (prev back); -1 ends
    int64_t next = -1;
    int64_t prev = -1;
    int64_t kids = 0;  // how many children, plus kHashed when the hash map finds them
};

// The nodes by id, in blocks of kBlock (2 MiB): the first block grows by doubling (a short request's tree
// stays small), the others are allocated whole, 2 MiB aligned with huge pages asked for (Linux:
// madvise(MADV_HUGEPAGE), which transparent huge pages honour in their default "madvise" mode).  A tree
// grows by one cache line per new node, and in a plain vector faulting in 4 KiB pages (and clearing the
// pages of each larger copy) took about 70% of an append's time (measured, in the kernel, for a request
// tree over text that does not repeat itself); in blocks nothing is copied or cleared twice and a fault
// brings in 32768 nodes.
class Nodes {
  public:
    static constexpr int64_t kShift = 15;
    static constexpr int64_t kBlock = int64_t(1) << kShift;

    Nodes() { grow(); }
    Nodes(const Nodes&) = delete;
    Nodes& operator=(const Nodes&) = delete;
    ~Nodes() {
        for (Node* b : blocks_) std::free(b);
    }

    Node& operator[](int64_t c) { return blocks_[static_cast<size_t>(c >> kShift)][c & (kBlock - 1)]; }
    const Node& operator[](int64_t c) const {
        return blocks_[static_cast<size_t>(c >> kShift)][c & (kBlock - 1)];
    }
    int64_t size() const { return size_; }  // node ids with room

    // Room for more node ids, blank (a free node's fields).  Throws std::bad_alloc.
    void grow() {
        if (size_ < kBlock) {  // the first block, twice as long (at least 64)
            int64_t n = size_ ? 2 * size_ : 64;
            Node* bigger = static_cast<Node*>(std::malloc(static_cast<size_t>(n) * sizeof(Node)));
            if (!bigger) throw std::bad_alloc();
            if (size_) std::memcpy(static_cast<void*>(bigger), blocks_[0], static_cast<size_t>(size_) * sizeof(Node));
            for (int64_t i = size_; i < n; ++i) new (bigger + i) Node();
            if (blocks_.empty()) {
                blocks_.push_back(bigger);
            } else {
                std::free(blocks_[0]);
                blocks_[0] = bigger;
            }
            size_ = n;
            return;
        }
        size_t bytes = static_cast<size_t>(kBlock) * sizeof(Node);
        blocks_.reserve(blocks_.size() + 1);  // before the allocation: nothing to undo if this throws
        void* p = std::aligned_alloc(bytes, bytes);
        if (!p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
        madvise(p, bytes, MADV_HUGEPAGE);  // a hint: without huge pages, ordinary ones
#endif
        Node* block = static_cast<Node*>(p);
        for (int64_t i = 0; i < kBlock; ++i) new (block + i) Node();
        blocks_.push_back(block);
        size_ += kBlock;
    }

  private:
    std::vector<Node*> blocks_;
    int64_t size_ = 0;
};

struct Tree {
    int64_t max_depth;
    Nodes nd;  // by node id
    EdgeMap edges;
    std::vector<int64_t> free_ids;  // dropped ids to reuse, the next one last
    int64_t top = 1;                // ids from here on were never used
    int64_t nodes = 1;
    // an allocation failed inside a change: the tree may be half changed, so every later call is refused
    // (changes answer "out of memory" again, questions answer "nothing": no child, no match, no draft)
    bool broken = false;
    std::vector<int64_t> scratch;  // a cursor's new suffixes, a matcher's grown nodes

    explicit Tree(int64_t depth) : max_depth(depth), scratch(static_cast<size_t>(depth) + 1) {}

    static uint64_t key(int64_t node, int64_t tok) {
        return (static_cast<uint64_t>(node) << 32) | static_cast<uint64_t>(tok);
    }

    // node's child under tok (a valid node id and token), -1 when none.
    int64_t find(int64_t node, int64_t tok) const {
        if (nd[node].kids & kHashed) return edges.get(key(node, tok));
        for (int64_t c = nd[node].first; c >= 0; c = nd[c].next)
            if (nd[c].token == tok) return c;
        return -1;
    }

    int64_t child(int64_t node, int64_t tok) const {
        if (tok < 0 || tok > kMaxToken || node < 0 || node >= nd.size()) return -1;
        return find(node, tok);
    }

    // c (new, its token set) becomes node's first child.
    void link(int64_t node, int64_t c, int64_t tok) {
        int64_t after = nd[c].next = nd[node].first;
        if (after >= 0) nd[after].prev = c;
        nd[node].first = c;
        int64_t n = ++nd[node].kids;
        if (n & kHashed) {
            edges.put(key(node, tok), c);
        } else if (n > kChainMax) {  // from now on the map finds node's children
            nd[node].kids |= kHashed;
            for (int64_t k = c; k >= 0; k = nd[k].next) edges.put(key(node, nd[k].token), k);
        }
    }

    // c (node's child under tok) leaves node's children.
    void unlink(int64_t node, int64_t c, int64_t tok) {
        int64_t before = nd[c].prev, after = nd[c].next;
        if (before >= 0)
            nd[before].next = after;
        else
            nd[node].first = after;
        if (after >= 0) nd[after].prev = before;
        nd[c].prev = -1;
        int64_t n = --nd[node].kids;
        if (n & kHashed) {
            edges.erase(key(node, tok));
            if ((n & ~kHashed) <= kChainMax / 2) {  // few enough to walk again
                for (int64_t k = nd[node].first; k >= 0; k = nd[k].next) edges.erase(key(node, nd[k].token));
                nd[node].kids = n & ~kHashed;
            }
        }
    }

    // A child of node lost a count or left: its most frequent child again (ties: the smaller token id).
    void rerank(int64_t node) {
        int64_t top_count = 0, top_token = -1, found = -1;
        for (int64_t c = nd[node].first; c >= 0; c = nd[c].next) {
            int64_t k = nd[c].count;
            if (k > top_count || (k == top_count && nd[c].token < top_token)) {
                top_count = k;
                top_token = nd[c].token;
                found = c;
            }
        }
        nd[node].best = found;
    }

    // Cursor.append of a known id: state[0] = how many suffixes, state[1..] their node ids (state[1] the root).
    void append(int64_t* state, int64_t tok) {
        int64_t n_active = state[0];
        int64_t* active = state + 1;
        int64_t* grown = scratch.data();
        int64_t n_grown = 0;
        grown[n_grown++] = 0;
        int64_t created = 0;
        for (int64_t i = 0; i < n_active; ++i) {
            int64_t node = active[i];
            // a longer suffix than one just created is new too (it holds that one as its suffix): no lookup
            int64_t c = created ? -1 : find(node, tok);
            int64_t held;
            if (c < 0) {  // a new node (its fields are a free node's: no children), first in its parent's chain
                if (!free_ids.empty()) {
                    c = free_ids.back();
                    free_ids.pop_back();
                } else {
                    c = top;
                    if (c == nd.size()) nd.grow();  // may throw: top is moved only once the room is there
                    ++top;
                }
                nd[c].count = held = 1;
                nd[c].token = tok;
                nd[c].kids = 0;
                link(node, c, tok);
                ++created;
            } else {
                held = ++nd[c].count;
            }
            ++nd[node].out;
            int64_t rival = nd[node].best;
            if (rival != c) {  // is the child now the most frequent? (ties: the smaller token id)
                if (rival < 0) {
                    nd[node].best = c;
                } else {
                    int64_t theirs = nd[rival].count;
                    if (held > theirs || (held == theirs && tok < nd[rival].token)) nd[node].best = c;
                }
            }
            grown[n_grown++] = c;
        }
        nodes += created;
        if (n_grown > max_depth) n_grown = max_depth;  // the root plus suffixes of 1 .. max_depth - 1 ids
        std::memcpy(active, grown, static_cast<size_t>(n_grown) * sizeof(int64_t));
        state[0] = n_grown;
    }

    // Whether remove(ids) would find every node it takes a count from, each with the counts it takes (ids
    // that were added): checked before anything changes, so a refused remove leaves the tree as it was.
    bool removable(const int64_t* ids, int64_t n) const {
        std::unordered_map<int64_t, int64_t> taken;  // node id -> counts remove() would take from it
        for (int64_t i = 0; i < n; ++i) {
            int64_t node = 0;
            int64_t end = i + max_depth < n ? i + max_depth : n;
            for (int64_t j = i; j < end; ++j) {
                int64_t tok = ids[j];
                if (tok < 0) break;
                if (tok > kMaxToken) return false;
                int64_t c = find(node, tok);
                if (c < 0 || ++taken[c] > nd[c].count) return false;
                node = c;
            }
        }
        return true;
    }

    // SuffixTree.remove; false (nothing changed) when ids were never added (``removable``).
    bool remove(const int64_t* ids, int64_t n) {
        if (!removable(ids, n)) return false;
        for (int64_t i = 0; i < n; ++i) {
            int64_t node = 0;
            int64_t end = i + max_depth < n ? i + max_depth : n;
            for (int64_t j = i; j < end; ++j) {
                int64_t tok = ids[j];
                if (tok < 0) break;
                if (tok > kMaxToken) return false;
                int64_t c = find(node, tok);
                --nd[node].out;
                int64_t left = --nd[c].count;
                if (left == 0) {  // drop it: out of the edges and of its parent's chain of children
                    unlink(node, c, tok);
                    free_ids.push_back(c);
                    --nodes;
                }
                if (c == nd[node].best) rerank(node);
                node = c;
            }
        }
        return true;
    }
};

}  // namespace

extern "C" {

int mechserve_suffix_tree_abi(void) { return 2; }

// A new tree holding only the root; null when max_depth < 2 or out of memory.
void* mechserve_suffix_tree_new(int64_t max_depth) {
    if (max_depth < 2) return nullptr;
    try {
        Tree* made = new Tree(max_depth);
        ++live_trees;
        return made;
    } catch (...) {  // no C++ exception may leave through ctypes (it would end the process)
        return nullptr;
    }
}

void mechserve_suffix_tree_destroy(void* tree) {
    if (tree) --live_trees;
    delete static_cast<Tree*>(tree);
}

// How many trees this process holds (made and not destroyed).
int64_t mechserve_suffix_tree_live(void) { return live_trees.load(); }

// 0 nodes held, 1 ids ever used (top), 2 the node vectors' length, 3 free ids, 4 max_depth; -1 otherwise.
int64_t mechserve_suffix_tree_stat(void* handle, int64_t which) {
    const Tree* t = static_cast<const Tree*>(handle);
    switch (which) {
        case 0: return t->nodes;
        case 1: return t->top;
        case 2: return t->nd.size();
        case 3: return static_cast<int64_t>(t->free_ids.size());
        case 4: return t->max_depth;
        default: return -1;
    }
}

// A node's field (0 count, 1 out, 2 best, 3 token, 4 first, 5 next, 6 prev); 0 and *ok = 0 when the node
// id or the field is out of range.
int64_t mechserve_suffix_tree_field(void* handle, int64_t field, int64_t node, int64_t* ok) {
    const Tree* t = static_cast<const Tree*>(handle);
    *ok = 0;
    if (node < 0 || node >= t->nd.size() || field < 0 || field >= 7) return 0;
    const Node& n = t->nd[static_cast<size_t>(node)];
    const int64_t columns[] = {n.count, n.out, n.best, n.token, n.first, n.next, n.prev};
    *ok = 1;
    return columns[field];
}

// The free ids, oldest first, into out (room for cap); returns how many there are.
int64_t mechserve_suffix_tree_free_ids(void* handle, int64_t* out, int64_t cap) {
    const Tree* t = static_cast<const Tree*>(handle);
    int64_t n = static_cast<int64_t>(t->free_ids.size());
    for (int64_t i = 0; i < n && i < cap; ++i) out[i] = t->free_ids[static_cast<size_t>(i)];
    return n;
}

// node's child under token, -1 when none (or token outside 0 .. 2**32 - 1).
int64_t mechserve_suffix_tree_child(void* handle, int64_t node, int64_t token) {
    const Tree* t = static_cast<const Tree*>(handle);
    return t->broken ? -1 : t->child(node, token);
}

// node's children in chain order: their tokens and node ids into tokens/nodes (room for cap each); returns
// how many there are (more than cap: call again with more room), -1 for a node id out of range.
int64_t mechserve_suffix_tree_children(void* handle, int64_t node, int64_t* tokens, int64_t* nodes, int64_t cap) {
    const Tree* t = static_cast<const Tree*>(handle);
    if (node < 0 || node >= t->nd.size()) return -1;
    if (t->broken) return 0;
    int64_t n = 0;
    for (int64_t c = t->nd[node].first; c >= 0; c = t->nd[c].next, ++n) {
        if (n < cap) {
            tokens[n] = t->nd[c].token;
            nodes[n] = c;
        }
    }
    return n;
}

// A cursor's state, an int64 buffer of 2 + max_depth entries: [the tree (its handle), k, the node ids of the
// sequence's last k suffixes, the empty one (the root) first]; a new cursor's: [tree, 1, 0].

// Cursor.append of each of ids[0 .. n) in turn; an id < 0 breaks the sequence (the cursor back to the root
// alone).  Returns n, or the index of the first id above 2**32 - 1 (not added, nor any after it), or -1 out
// of memory.
int64_t mechserve_suffix_tree_extend(int64_t* cursor, const int64_t* ids, int64_t n) {
    Tree* t = reinterpret_cast<Tree*>(cursor[0]);
    int64_t* state = cursor + 1;
    if (t->broken) return -1;
    try {
        for (int64_t i = 0; i < n; ++i) {
            int64_t tok = ids[i];
            if (tok < 0) {
                state[0] = 1;
                state[1] = 0;
            } else if (tok > kMaxToken) {
                return i;
            } else {
                t->append(state, tok);
            }
        }
    } catch (...) {
        t->broken = true;
        return -1;
    }
    return n;
}

// Cursor.append of one id (0 <= token <= 2**32 - 1: the caller checks): 0, or -1 out of memory.
int64_t mechserve_suffix_tree_append(int64_t* cursor, int64_t token) {
    Tree* t = reinterpret_cast<Tree*>(cursor[0]);
    if (t->broken) return -1;
    try {
        t->append(cursor + 1, token);
    } catch (...) {
        t->broken = true;
        return -1;
    }
    return 0;
}

// SuffixTree.remove(ids[0 .. n)): 0, -1 when some id's node is missing (ids never added), -2 out of memory.
int64_t mechserve_suffix_tree_remove(void* handle, const int64_t* ids, int64_t n) {
    Tree* t = static_cast<Tree*>(handle);
    if (t->broken) return -2;
    try {
        return t->remove(ids, n) ? 0 : -1;
    } catch (...) {  // in removable(): nothing changed yet; in remove() proper nothing allocates
        return -2;
    }
}

// A matcher's node ids live in int64 buffers of max_depth entries: [k, the node ids of the suffixes of 1 .. k
// ids].

// SuffixTree.matches(context[0 .. n)): the node ids of the held suffixes, by length, into the buffer out;
// returns how many.
int64_t mechserve_suffix_tree_matches(void* handle, const int64_t* context, int64_t n, int64_t* out) {
    const Tree* t = static_cast<const Tree*>(handle);
    int64_t longest = t->broken ? 0 : n < t->max_depth - 1 ? n : t->max_depth - 1;
    int64_t found = 0;
    for (int64_t m = 1; m <= longest; ++m) {
        int64_t node = 0;
        for (int64_t j = n - m; j < n; ++j) {
            node = t->child(node, context[j]);
            if (node < 0) {
                out[0] = found;
                return found;
            }
        }
        out[++found] = node;
    }
    out[0] = found;
    return found;
}

// Matcher's extension: the buffer from's node ids, of a sequence's suffixes, after ids[0 .. n) are appended
// to it, into the buffer to (which may be from); returns how many.
int64_t mechserve_suffix_tree_follow(void* handle, const int64_t* from, const int64_t* ids, int64_t n, int64_t* to) {
    Tree* t = static_cast<Tree*>(handle);
    if (t->broken) {
        to[0] = 0;
        return 0;
    }
    int64_t longest = t->max_depth - 2;
    int64_t* grown = t->scratch.data();
    int64_t k = from[0];
    std::memmove(to, from, static_cast<size_t>(k + 1) * sizeof(int64_t));
    int64_t* nodes = to + 1;
    for (int64_t i = 0; i < n; ++i) {
        int64_t tok = ids[i];
        if (tok < 0) {
            k = 0;
            continue;
        }
        int64_t g = 0;
        int64_t parents = 1 + (k < longest ? k : longest);
        for (int64_t p = 0; p < parents; ++p) {
            int64_t c = t->child(p == 0 ? 0 : nodes[p - 1], tok);
            if (c < 0) break;
            grown[g++] = c;
        }
        std::memcpy(nodes, grown, static_cast<size_t>(g) * sizeof(int64_t));
        k = g;
    }
    to[0] = k;
    return k;
}

// best_draft: the best-scoring draft of at most ask[0] ids from matched[0 .. n) (matched[m - 1]: the node of
// the suffix of m ids), against a rival of score real[2] from a match of ask[1] ids; real[0] is
// max_spec_factor, real[1] min_token_prob.  Writes the winner's match length into ask[2], its ids into
// ask[3 ..] (room for max_depth) and its score into real[3], and returns how many ids; 0 when nothing beats
// the rival; -2 for a node id not in the tree; -3 when max_spec_factor * m is not a finite number.
int64_t mechserve_suffix_tree_best_draft(void* handle, const int64_t* matched, int64_t n, int64_t* ask, double* real) {
    Tree* t = static_cast<Tree*>(handle);
    if (t->broken) return 0;
    for (int64_t i = 0; i < n; ++i)
        if (matched[i] < 0 || matched[i] >= t->top) return -2;
    const int64_t num = ask[0];
    const double max_spec_factor = real[0], min_token_prob = real[1];
    double best_score = real[2];
    int64_t best_length = ask[1], best_n = 0;
    int64_t* ids = ask + 3;
    if (num <= 0) return 0;
    const Nodes& nd = t->nd;
    int64_t lo = 0, hi = n;  // the longest match with a child: matched[lo - 1] (none: lo == 0)
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (nd[matched[mid - 1]].best >= 0)
            lo = mid;
        else
            hi = mid - 1;
    }
    int64_t* draft = t->scratch.data();  // room for max_depth + 1: a path below a match is shorter
    for (int64_t m = lo; m > 0; --m) {
        double scaled = max_spec_factor * static_cast<double>(m);
        if (!std::isfinite(scaled)) return -3;
        int64_t budget = scaled >= 9.2e18 ? INT64_MAX : scaled <= -9.2e18 ? INT64_MIN : static_cast<int64_t>(scaled);
        if (num < budget) budget = num;
        double as_double = static_cast<double>(budget);
        if (as_double < best_score || (as_double == best_score && m <= best_length)) break;
        int64_t node = matched[m - 1];
        int64_t drafted = 0;
        double prob = 1.0, sum = 0.0;
        int64_t c = nd[node].best;
        // a path below a match is shorter than max_depth in a tree built by these functions; the bound keeps
        // the buffers (max_depth + 1 and max_depth ids) whatever the tree holds
        while (drafted < budget && drafted < t->max_depth && c >= 0) {
            prob *= static_cast<double>(nd[c].count) / static_cast<double>(nd[node].out);
            if (prob < min_token_prob) break;
            draft[drafted++] = nd[c].token;
            sum += prob;
            node = c;
            c = nd[node].best;
        }
        if (drafted && (sum > best_score || (sum == best_score && m > best_length))) {
            best_score = sum;
            best_length = m;
            best_n = drafted;
            std::memcpy(ids, draft, static_cast<size_t>(drafted) * sizeof(int64_t));
        }
    }
    if (best_n) {
        real[3] = best_score;
        ask[2] = best_length;
    }
    return best_n;
}

}  // extern "C"
