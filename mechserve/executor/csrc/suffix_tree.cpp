// Suffix decoding's depth-bounded suffix trie (mechserve/executor/proposers_suffix.py), natively: the same
// algorithm as the Python ``SuffixTree``/``Cursor``/``Matcher``/``best_draft`` (the reference this is tested
// against), step for step, so node ids, counts, ties and drafts come out identical; only the cost differs
// (one foreign call per id appended instead of up to max_depth dict and array updates in the interpreter).
//
// A node is an int64 id (0: the root, the empty substring); its fields are entries of int64 vectors:
// count (occurrences of its substring), out (ids that followed it: its children's counts summed), best (its
// most frequent child, ties to the smaller token id; -1 without children), token (the id on the edge into
// it), first/next/prev (its parent's chain of children, -1 ends).  Edges live in one open-addressing hash
// map keyed by (parent << 32) | token (linear probing, deletion by backward shift: no tombstones, so a
// tree that adds and removes forever keeps its probe lengths).  Dropped node ids are reused last-freed
// first, before ids never used, exactly as the Python tree does.
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
#include <cstring>
#include <new>
#include <vector>

namespace {

constexpr int64_t kMaxToken = (int64_t(1) << 32) - 1;
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

struct Tree {
    int64_t max_depth;
    std::vector<int64_t> count{0}, out{0}, best{-1}, token{-1}, first{-1}, next{-1}, prev{-1};
    EdgeMap edges;
    std::vector<int64_t> free_ids;  // dropped ids to reuse, the next one last
    int64_t top = 1;                // ids from here on were never used
    int64_t nodes = 1;
    std::vector<int64_t> scratch;  // a cursor's new suffixes, a matcher's grown nodes

    explicit Tree(int64_t depth) : max_depth(depth), scratch(static_cast<size_t>(depth) + 1) {}

    static uint64_t key(int64_t node, int64_t tok) {
        return (static_cast<uint64_t>(node) << 32) | static_cast<uint64_t>(tok);
    }

    int64_t child(int64_t node, int64_t tok) const {
        if (tok < 0 || tok > kMaxToken || node < 0) return -1;
        return edges.get(key(node, tok));
    }

    // Room for more nodes: every vector half as long again (at least 64 entries), blank.
    void grow() {
        size_t more = count.size() / 2 > 64 ? count.size() / 2 : 64;
        size_t n = count.size() + more;
        count.resize(n, 0);
        out.resize(n, 0);
        best.resize(n, -1);
        token.resize(n, -1);
        first.resize(n, -1);
        next.resize(n, -1);
        prev.resize(n, -1);
    }

    // A child of node lost a count or left: its most frequent child again (ties: the smaller token id).
    void rerank(int64_t node) {
        int64_t top_count = 0, top_token = -1, found = -1;
        for (int64_t c = first[node]; c >= 0; c = next[c]) {
            int64_t k = count[c];
            if (k > top_count || (k == top_count && token[c] < top_token)) {
                top_count = k;
                top_token = token[c];
                found = c;
            }
        }
        best[node] = found;
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
            uint64_t k = key(node, tok);
            // a longer suffix than one just created is new too (it holds that one as its suffix): no lookup
            int64_t c = created ? -1 : edges.get(k);
            int64_t held;
            if (c < 0) {  // a new node (its fields are a free node's: no children), first in its parent's chain
                if (!free_ids.empty()) {
                    c = free_ids.back();
                    free_ids.pop_back();
                } else {
                    c = top++;
                    if (c == static_cast<int64_t>(count.size())) grow();
                }
                edges.put(k, c);
                count[c] = held = 1;
                token[c] = tok;
                int64_t after = next[c] = first[node];
                if (after >= 0) prev[after] = c;
                first[node] = c;
                ++created;
            } else {
                held = ++count[c];
            }
            ++out[node];
            int64_t rival = best[node];
            if (rival != c) {  // is the child now the most frequent? (ties: the smaller token id)
                if (rival < 0) {
                    best[node] = c;
                } else {
                    int64_t theirs = count[rival];
                    if (held > theirs || (held == theirs && tok < token[rival])) best[node] = c;
                }
            }
            grown[n_grown++] = c;
        }
        nodes += created;
        if (n_grown > max_depth) n_grown = max_depth;  // the root plus suffixes of 1 .. max_depth - 1 ids
        std::memcpy(active, grown, static_cast<size_t>(n_grown) * sizeof(int64_t));
        state[0] = n_grown;
    }

    // SuffixTree.remove; false when an id's node is missing (ids never added), the tree then partly updated.
    bool remove(const int64_t* ids, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
            int64_t node = 0;
            int64_t end = i + max_depth < n ? i + max_depth : n;
            for (int64_t j = i; j < end; ++j) {
                int64_t tok = ids[j];
                if (tok < 0) break;
                if (tok > kMaxToken) return false;
                uint64_t k = key(node, tok);
                int64_t c = edges.get(k);
                if (c < 0) return false;
                --out[node];
                int64_t left = --count[c];
                if (left == 0) {  // drop it: out of the edges and of its parent's chain of children
                    edges.erase(k);
                    int64_t before = prev[c], after = next[c];
                    if (before >= 0)
                        next[before] = after;
                    else
                        first[node] = after;
                    if (after >= 0) prev[after] = before;
                    prev[c] = -1;
                    free_ids.push_back(c);
                    --nodes;
                }
                if (c == best[node]) rerank(node);
                node = c;
            }
        }
        return true;
    }
};

}  // namespace

extern "C" {

int mechserve_suffix_tree_abi(void) { return 1; }

// A new tree holding only the root; null when max_depth < 2 or out of memory.
void* mechserve_suffix_tree_new(int64_t max_depth) {
    if (max_depth < 2) return nullptr;
    try {
        Tree* made = new Tree(max_depth);
        ++live_trees;
        return made;
    } catch (const std::bad_alloc&) {
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
        case 2: return static_cast<int64_t>(t->count.size());
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
    if (node < 0 || node >= static_cast<int64_t>(t->count.size())) return 0;
    const std::vector<int64_t>* columns[] = {&t->count, &t->out, &t->best, &t->token, &t->first, &t->next, &t->prev};
    if (field < 0 || field >= 7) return 0;
    *ok = 1;
    return (*columns[field])[static_cast<size_t>(node)];
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
    return static_cast<const Tree*>(handle)->child(node, token);
}

// node's children in chain order: their tokens and node ids into tokens/nodes (room for cap each); returns
// how many there are (more than cap: call again with more room), -1 for a node id out of range.
int64_t mechserve_suffix_tree_children(void* handle, int64_t node, int64_t* tokens, int64_t* nodes, int64_t cap) {
    const Tree* t = static_cast<const Tree*>(handle);
    if (node < 0 || node >= static_cast<int64_t>(t->count.size())) return -1;
    int64_t n = 0;
    for (int64_t c = t->first[node]; c >= 0; c = t->next[c], ++n) {
        if (n < cap) {
            tokens[n] = t->token[c];
            nodes[n] = c;
        }
    }
    return n;
}

// Cursor.append of each of ids[0 .. n) in turn; state: [k, k node ids] with room for 1 + max_depth entries
// (a new cursor: [1, 0]).  An id < 0 breaks the sequence (state back to [1, 0]).  Returns n, or the index of
// the first id above 2**32 - 1 (not added, nor any after it), or -1 out of memory.
int64_t mechserve_suffix_tree_extend(void* handle, int64_t* state, const int64_t* ids, int64_t n) {
    Tree* t = static_cast<Tree*>(handle);
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
    } catch (const std::bad_alloc&) {
        return -1;
    }
    return n;
}

// One id (0 <= token <= 2**32 - 1: the caller checks): 0, or -1 out of memory.
int64_t mechserve_suffix_tree_append(void* handle, int64_t* state, int64_t token) {
    try {
        static_cast<Tree*>(handle)->append(state, token);
    } catch (const std::bad_alloc&) {
        return -1;
    }
    return 0;
}

// SuffixTree.remove(ids[0 .. n)): 0, -1 when some id's node is missing (ids never added), -2 out of memory.
int64_t mechserve_suffix_tree_remove(void* handle, const int64_t* ids, int64_t n) {
    try {
        return static_cast<Tree*>(handle)->remove(ids, n) ? 0 : -1;
    } catch (const std::bad_alloc&) {
        return -2;
    }
}

// SuffixTree.matches(context[0 .. n)): the node ids of the held suffixes, by length, into out (room for
// max_depth - 1); returns how many.
int64_t mechserve_suffix_tree_matches(void* handle, const int64_t* context, int64_t n, int64_t* out) {
    const Tree* t = static_cast<const Tree*>(handle);
    int64_t longest = n < t->max_depth - 1 ? n : t->max_depth - 1;
    int64_t found = 0;
    for (int64_t m = 1; m <= longest; ++m) {
        int64_t node = 0;
        for (int64_t j = n - m; j < n; ++j) {
            node = t->child(node, context[j]);
            if (node < 0) return found;
        }
        out[found++] = node;
    }
    return found;
}

// Matcher's extension: the node ids nodes[0 .. k) of a sequence's suffixes after ids[0 .. n) are appended
// to it, into out (room for max_depth - 1; may be nodes itself); returns how many.
int64_t mechserve_suffix_tree_follow(void* handle, const int64_t* nodes, int64_t k, const int64_t* ids, int64_t n,
                                     int64_t* out) {
    Tree* t = static_cast<Tree*>(handle);
    int64_t longest = t->max_depth - 2;
    std::vector<int64_t>& grown = t->scratch;
    std::memmove(out, nodes, static_cast<size_t>(k) * sizeof(int64_t));
    for (int64_t i = 0; i < n; ++i) {
        int64_t tok = ids[i];
        if (tok < 0) {
            k = 0;
            continue;
        }
        int64_t g = 0;
        int64_t parents = 1 + (k < longest ? k : longest);
        for (int64_t p = 0; p < parents; ++p) {
            int64_t c = t->child(p == 0 ? 0 : out[p - 1], tok);
            if (c < 0) break;
            grown[g++] = c;
        }
        std::memcpy(out, grown.data(), static_cast<size_t>(g) * sizeof(int64_t));
        k = g;
    }
    return k;
}

// best_draft: the best-scoring draft of at most num ids from matched[0 .. n) (matched[m - 1]: the node of
// the suffix of m ids), against a rival of score beat_score from a match of beat_length ids.  Writes the
// winner's ids into ids (room for max_depth), its score into *score and its match length into *length and
// returns how many ids; 0 when nothing beats the rival; -2 for a node id not in the tree; -3 when
// max_spec_factor * m is not a finite number.
int64_t mechserve_suffix_tree_best_draft(void* handle, const int64_t* matched, int64_t n, int64_t num,
                                         double max_spec_factor, double min_token_prob, double beat_score,
                                         int64_t beat_length, int64_t* ids, double* score, int64_t* length) {
    Tree* t = static_cast<Tree*>(handle);
    for (int64_t i = 0; i < n; ++i)
        if (matched[i] < 0 || matched[i] >= t->top) return -2;
    double best_score = beat_score;
    int64_t best_length = beat_length, best_n = 0;
    if (num <= 0) return 0;
    const int64_t* count = t->count.data();
    const int64_t* out = t->out.data();
    const int64_t* follow = t->best.data();
    const int64_t* token = t->token.data();
    int64_t lo = 0, hi = n;  // the longest match with a child: matched[lo - 1] (none: lo == 0)
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (follow[matched[mid - 1]] >= 0)
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
        int64_t c = follow[node];
        while (drafted < budget && c >= 0) {
            prob *= static_cast<double>(count[c]) / static_cast<double>(out[node]);
            if (prob < min_token_prob) break;
            draft[drafted++] = token[c];
            sum += prob;
            node = c;
            c = follow[node];
        }
        if (drafted && (sum > best_score || (sum == best_score && m > best_length))) {
            best_score = sum;
            best_length = m;
            best_n = drafted;
            std::memcpy(ids, draft, static_cast<size_t>(drafted) * sizeof(int64_t));
        }
    }
    if (best_n) {
        *score = best_score;
        *length = best_length;
    }
    return best_n;
}

}  // extern "C"
