// Fuzz test of the checkpoint header parser (train/detail/checkpoint_format.hpp): a deterministic
// mutator over a valid file (bit flips, extreme values written over header fields, truncation,
// appended bytes, with the header CRC usually recomputed so the mutation reaches the table
// parser) and hand-made hostile headers. Every input is either parsed consistently (every
// section found by its name) or refused with lockstep::error (checkpoint); no allocation made
// while parsing exceeds the file's size (or 4 KiB, the room error messages need). The
// header-only parse (parse_header_prefix, used when a load at another replica count reads only
// a shard's header and some sections) accepts exactly the headers the whole-file parse accepts,
// with the same sections. Run under the asan preset (ASan + UBSan) in CI.
// SPDX-License-Identifier: Apache-2.0
// The replacement operator new/delete below pair malloc with free; GCC's heuristic does not see
// through the replacement and warns at every inlined std::allocator call.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
#include <catch2/catch.hpp>

#include "lockstep/train/detail/checkpoint_format.hpp"
#include "lockstep/train/detail/checkpoint_parser.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "allocation_tracker.hpp"
#include "support/splitmix64.hpp"

namespace {

namespace ck = lockstep::detail::ckpt;
using bytes = std::vector<std::byte>;

constexpr std::size_t message_room = 4096;

/// What parsing one input did.
struct outcome {
    bool parsed = false;
    bool refused = false; ///< lockstep::error with errc::checkpoint
    std::string message;
    std::size_t largest_allocation = 0;
    bool prefix_agrees = true; ///< parse_header_prefix on the header bytes: same verdict, table
};

/// The bytes a reader of the header alone takes from `file` (checkpoint_resize.hpp): the fixed
/// part, then as many as the header length field says when that lies inside the file.
bytes header_prefix(const bytes& file) {
    bytes head(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(
                                                std::min(file.size(), ck::min_header_bytes)));
    if (head.size() == ck::min_header_bytes) {
        const std::uint64_t length = ck::get_u64(head.data() + 16);
        if (length > head.size() && length <= file.size())
            head.assign(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(length));
    }
    return head;
}

/// Whether parse_header_prefix on the header bytes of `file` agrees with parse_header on the
/// whole file: both refuse, or both accept with the same metadata and sections.
bool prefix_agrees(const bytes& file) {
    std::optional<ck::parsed_header> whole, part;
    const bytes head = header_prefix(file);
    try {
        whole = ck::parse_header(file, ck::shard_magic, "fuzz");
    } catch (const lockstep::error&) {
    }
    try {
        part = ck::parse_header_prefix(head, file.size(), ck::shard_magic, "fuzz");
    } catch (const lockstep::error& e) {
        if (e.code() != lockstep::errc::checkpoint)
            return false;
    }
    if (whole.has_value() != part.has_value())
        return false;
    if (!whole)
        return true;
    if (whole->meta_count() != part->meta_count() ||
        whole->section_count() != part->section_count())
        return false;
    for (std::size_t i = 0; i < whole->meta_count(); ++i)
        if (whole->meta(i) != part->meta(i))
            return false;
    for (std::size_t i = 0; i < whole->section_count(); ++i) {
        const ck::section_entry a = whole->section(i), b = part->section(i);
        if (a.name != b.name || a.type != b.type || a.shape != b.shape || a.offset != b.offset ||
            a.length != b.length || a.crc != b.crc)
            return false;
    }
    return true;
}

/// Parses `file` like a load does (header, then every section's CRC and padding, then every
/// entry decoded), measuring allocations.
outcome parse(const bytes& file) {
    outcome o;
    largest = 0;
    tracking = true;
    try {
        const ck::parsed_header h = ck::parse_header(file, ck::shard_magic, "fuzz");
        const auto problems = ck::verify_sections(file, h);
        for (std::size_t i = 0; i < h.meta_count(); ++i)
            (void)h.meta(i);
        for (std::size_t i = 0; i < h.section_count(); ++i) {
            const ck::section_entry s = h.section(i);
            // A parsed section lies inside the file and its shape matches its length.
            std::uint64_t n = ck::dtype_size(s.type);
            for (std::uint64_t d : s.shape)
                n *= d;
            if (s.offset + s.length > file.size() || n != s.length)
                throw std::logic_error("inconsistent section accepted: " + s.name);
            // Found by its name (the names are unique): this very entry.
            if (const auto f = h.find_section(s.name); !f || f->offset != s.offset)
                throw std::logic_error("find_section misses section " + s.name);
        }
        o.parsed = problems.empty();
        o.refused = !problems.empty();
    } catch (const lockstep::error& e) {
        o.refused = e.code() == lockstep::errc::checkpoint;
        o.message = e.what();
    }
    tracking = false;
    o.largest_allocation = largest;
    o.prefix_agrees = prefix_agrees(file);
    return o;
}

/// A valid file: metadata and sections of every element type.
bytes valid_file() {
    ck::file_builder b;
    b.meta("trainer", "data_parallel");
    b.meta("dtype", "float");
    b.meta("optimizer", "sgd");
    b.meta("empty", "");
    const std::vector<float> w = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    const std::vector<double> m = {0.5, -0.25, 3, 4, 5};
    const std::vector<std::uint64_t> c = {7, 1234, 1, 42};
    const std::int64_t step = 7;
    const std::vector<std::uint8_t> u = {1, 2, 3};
    b.section<float>("param.w", {3, 4}, w);
    b.section<double>("optimizer.m", {5}, m);
    b.section<std::uint64_t>("trainer.counters", {4}, c);
    b.section<std::int64_t>("optimizer.step", {1}, std::span<const std::int64_t>(&step, 1));
    b.section<std::uint8_t>("bytes", {3}, u);
    return b.finish(ck::shard_magic);
}

void put32(bytes& f, std::size_t at, std::uint32_t v) {
    for (int i = 0; i < 4 && at + i < f.size(); ++i)
        f[at + i] = std::byte((v >> (8 * i)) & 0xFF);
}
void put64(bytes& f, std::size_t at, std::uint64_t v) {
    for (int i = 0; i < 8 && at + i < f.size(); ++i)
        f[at + i] = std::byte((v >> (8 * i)) & 0xFF);
}
/// Recomputes the header CRC (where the header length field allows) and optionally the file
/// length field, so that a mutation gets past the first checks.
void fix_up(bytes& f, bool length_too) {
    if (f.size() < ck::min_header_bytes)
        return;
    if (length_too)
        put64(f, 24, f.size());
    const std::uint64_t h = ck::get_u64(f.data() + 16);
    if (h >= ck::min_header_bytes && h <= f.size())
        put32(f, h - 4, lockstep::crc32c(std::span<const std::byte>(f).first(h - 4)));
}

/// splitmix64: a deterministic stream of random words.
using rng = lockstep_test::splitmix64;

const std::uint64_t extremes[] = {0,
                                  1,
                                  2,
                                  7,
                                  8,
                                  44,
                                  0x7F,
                                  0xFF,
                                  0xFFFF,
                                  0x7FFFFFFFull,
                                  0x80000000ull,
                                  0xFFFFFFFFull,
                                  0x100000000ull,
                                  0x4000000000000000ull,
                                  0x7FFFFFFFFFFFFFFFull,
                                  0x8000000000000000ull,
                                  0xFFFFFFFFFFFFFFF8ull,
                                  0xFFFFFFFFFFFFFFFFull};

} // namespace

TEST_CASE("the header parser survives a deterministic mutation fuzz", "[train][checkpoint][fuzz]") {
    const bytes good = valid_file();
    {
        const outcome o = parse(good);
        REQUIRE(o.parsed);
    }
    const std::uint64_t header = ck::get_u64(good.data() + 16);
    rng r{20261122};
    std::size_t parsed = 0, refused = 0, deep = 0;
    const int iterations = 40000;
    for (int it = 0; it < iterations; ++it) {
        bytes f = good;
        const std::size_t mutations = 1 + r.below(4);
        for (std::size_t m = 0; m < mutations; ++m) {
            switch (r.below(7)) {
            case 0: { // flip a bit, mostly in the header
                const std::size_t span = r.below(4) == 0 ? f.size() : header;
                if (span > 0)
                    f[r.below(span)] ^= std::byte(1u << r.below(8));
                break;
            }
            case 1: // an extreme 32-bit value anywhere in the header
                put32(f, r.below(header), static_cast<std::uint32_t>(extremes[r.below(18)]));
                break;
            case 2: // an extreme 64-bit value anywhere in the header
                put64(f, r.below(header), extremes[r.below(18)]);
                break;
            case 3: // a random header length or count field
                if (r.below(2) == 0)
                    put64(f, 16, r.below(2) ? extremes[r.below(18)] : r.below(f.size() + 64));
                else
                    put32(f, 32 + 4 * r.below(2), static_cast<std::uint32_t>(r.next()));
                break;
            case 4: // truncate
                f.resize(r.below(f.size() + 1));
                break;
            case 5: { // append bytes
                const std::size_t n = 1 + r.below(64);
                for (std::size_t i = 0; i < n; ++i)
                    f.push_back(std::byte(r.below(2) ? 0 : r.next() & 0xFF));
                break;
            }
            default: // random bytes over a random stretch of the header
                for (std::size_t i = r.below(header), n = r.below(16); n > 0 && i < f.size();
                     --n, ++i)
                    f[i] = std::byte(r.next() & 0xFF);
                break;
            }
        }
        if (r.below(4) != 0)
            fix_up(f, r.below(2) == 0);
        const outcome o = parse(f);
        INFO("iteration " << it << ": " << o.message);
        REQUIRE((o.parsed || o.refused));
        REQUIRE(o.prefix_agrees);
        REQUIRE(o.largest_allocation <= std::max(f.size(), message_room));
        parsed += o.parsed;
        refused += o.refused;
        deep += o.message.find("header CRC32C") == std::string::npos &&
                o.message.find("records a file") == std::string::npos;
    }
    // The mutator must reach past the CRC check for the test to mean anything.
    CHECK(deep > static_cast<std::size_t>(iterations) / 4);
}

namespace {

/// One hand-made section entry.
struct entry {
    std::string name = "s";
    std::uint32_t code = 1; ///< f32
    std::uint32_t elem = 4;
    std::vector<std::uint64_t> dims = {2};
    std::uint64_t offset = 0; ///< 0: right after the header
    std::uint64_t length = 8;
    bool good_crc = true;
    std::uint32_t ndim_override =
        0xFFFFFFFF; ///< else the rank field written instead of dims.size()
};

/// Encodes a header with exactly these fields (valid CRC unless told otherwise), then
/// `payload` bytes of zeros.
bytes craft(const std::vector<entry>& entries, std::uint64_t payload, std::uint32_t meta_count = 0,
            std::uint32_t section_count = 0xFFFFFFFF, std::uint64_t header_override = 0,
            std::uint64_t length_override = 0, const bytes& meta_table = {}) {
    bytes table = meta_table;
    std::uint64_t header = ck::fixed_header_bytes + 4 + meta_table.size();
    for (const entry& e : entries)
        header += ck::min_section_bytes + e.name.size() + 8 * e.dims.size();
    std::uint64_t at = header;
    for (const entry& e : entries) {
        ck::put_string(table, e.name);
        ck::put_u32(table, e.code);
        ck::put_u32(table, e.elem);
        ck::put_u32(table, e.ndim_override != 0xFFFFFFFF
                               ? e.ndim_override
                               : static_cast<std::uint32_t>(e.dims.size()));
        for (auto d : e.dims)
            ck::put_u64(table, d);
        ck::put_u64(table, e.offset ? e.offset : at);
        ck::put_u64(table, e.length);
        ck::put_u32(table, e.good_crc ? 0 : 1); // zero bytes of payload: CRC of zeros below
        at += e.length < payload ? e.length : 0;
    }
    bytes f;
    for (char c : ck::shard_magic)
        f.push_back(std::byte(c));
    ck::put_u32(f, ck::format_version);
    ck::put_u32(f, ck::endian_marker);
    ck::put_u64(f, header_override ? header_override : header);
    ck::put_u64(f, length_override ? length_override : header + payload);
    ck::put_u32(f, meta_count);
    ck::put_u32(f, section_count != 0xFFFFFFFF ? section_count
                                               : static_cast<std::uint32_t>(entries.size()));
    f.insert(f.end(), table.begin(), table.end());
    ck::put_u32(f, lockstep::crc32c(std::span<const std::byte>(f)));
    f.resize(f.size() + payload, std::byte{0});
    return f;
}

void check_refused(const bytes& f, const std::string& part) {
    const outcome o = parse(f);
    INFO(o.message);
    CHECK(o.refused);
    CHECK_FALSE(o.parsed);
    CHECK(o.message.find(part) != std::string::npos);
    CHECK(o.largest_allocation <= std::max(f.size(), message_room));
}

} // namespace

TEST_CASE("hand-made hostile headers are refused before any large allocation",
          "[train][checkpoint][fuzz]") {
    SECTION("control: a crafted valid file with a zero-filled section parses") {
        entry e;
        const std::vector<std::byte> zeros(8);
        bytes f = craft({e}, 8);
        // Patch the section CRC (written as 0) to the CRC of its 8 zero bytes.
        const std::uint64_t h = ck::get_u64(f.data() + 16);
        put32(f, h - 8, lockstep::crc32c(zeros));
        fix_up(f, false);
        CHECK(parse(f).parsed);
    }
    SECTION("zero-length and tiny files") {
        check_refused({}, "fewer than the smallest header");
        check_refused(bytes(43), "fewer than the smallest header");
    }
    SECTION("header longer than the file") {
        check_refused(craft({}, 0, 0, 0, 1000), "header length 1000 is outside");
    }
    SECTION("header length below the fixed part") {
        check_refused(craft({}, 0, 0, 0, 12), "header length 12 is outside");
    }
    SECTION("a file length field beyond the file") {
        check_refused(craft({}, 0, 0, 0, 0, 0xFFFFFFFFFFFFFFFFull), "(truncated)");
    }
    SECTION("huge counts: 2^32 - 2 sections, 2^32 - 1 metadata entries") {
        check_refused(craft({}, 0, 0, 0xFFFFFFFEu), "do not fit in a header");
        check_refused(craft({}, 0, 0xFFFFFFFFu, 0), "do not fit in a header");
    }
    SECTION("a string longer than the header") {
        bytes meta;
        ck::put_u32(meta, 0xFFFFFFF0u);
        ck::put_u32(meta, 0);
        check_refused(craft({}, 0, 1, 0, 0, 0, meta), "metadata key needs 4294967280 bytes");
    }
    SECTION("a metadata key twice") {
        bytes meta;
        for (int i = 0; i < 2; ++i) {
            ck::put_string(meta, "world_size");
            ck::put_string(meta, std::to_string(i + 1));
        }
        check_refused(craft({}, 0, 2, 0, 0, 0, meta), "metadata key 'world_size' appears twice");
    }
    SECTION("shape-product overflow") {
        entry e;
        e.dims = {1ull << 32, 1ull << 32};
        check_refused(craft({e}, 8), "overflows 64 bits");
        e.dims = {1ull << 62};
        e.length = 0; // 2^62 elements of 4 bytes: the byte count overflows
        check_refused(craft({e}, 8), "do not hold its shape");
    }
    SECTION("huge section length and offsets outside the file") {
        entry e;
        e.dims = {1ull << 40};
        e.length = 4ull << 40;
        check_refused(craft({e}, 8), "are not between the header");
        entry n;
        n.offset = 0xFFFFFFFFFFFFFFF8ull; // a "negative" offset
        check_refused(craft({n}, 8), "are not between the header");
        entry in_header;
        in_header.offset = 8; // inside the header
        check_refused(craft({in_header}, 8), "are not between the header");
    }
    SECTION("overlapping sections") {
        entry a, b;
        b.name = "t";
        const bytes probe = craft({a, b}, 16);
        const std::uint64_t h = ck::get_u64(probe.data() + 16);
        a.offset = h;
        b.offset = h + 4;
        check_refused(craft({a, b}, 16), "overlap");
    }
    SECTION("too many dimensions, unknown element types, duplicate names") {
        entry e;
        e.ndim_override = 1000;
        check_refused(craft({e}, 8), "dimensions");
        entry t;
        t.code = 99;
        check_refused(craft({t}, 8), "not a known type");
        entry s;
        s.elem = 8; // f32 with an element size of 8
        check_refused(craft({s}, 8), "not a known type");
        entry a, b;
        check_refused(craft({a, b}, 16), "appears twice");
    }
    SECTION("a section CRC mismatch and non-zero padding") {
        entry e;
        e.good_crc = false;
        check_refused(craft({e}, 8), "");
        ck::file_builder b;
        const std::vector<float> v = {1};
        b.section<float>("a", {1}, v);
        b.section<float>("b", {1}, v);
        bytes f = b.finish(ck::shard_magic);
        // The 4 padding bytes after section a (4 bytes, aligned to 8).
        const std::uint64_t h = ck::get_u64(f.data() + 16);
        const std::uint64_t a_end = ((h + 7) / 8) * 8 + 4;
        f[a_end] = std::byte{1};
        const outcome o = parse(f);
        CHECK(o.refused);
    }
}

TEST_CASE("find_section finds each of many sections; a duplicate name is refused when saving",
          "[train][checkpoint]") {
    // File order differs from name order ("t10" before "t9"), and names prefix one another.
    std::vector<std::string> names = {"a", "a.b", "a.b.c", "b", "optimizer.step"};
    for (int i = 0; i < 2000; ++i)
        names.push_back((i % 2 ? "param.t" : "state.t") + std::to_string(i));
    ck::file_builder b;
    for (std::size_t i = 0; i < names.size(); ++i) {
        const std::vector<std::uint64_t> v(i % 3 + 1, i);
        b.section<std::uint64_t>(names[i], {v.size()}, v);
    }
    const bytes f = b.finish(ck::shard_magic);
    const ck::parsed_header h = ck::parse_header(f, ck::shard_magic, "many");
    REQUIRE(h.section_count() == names.size());
    for (std::size_t i = 0; i < names.size(); ++i) {
        const auto s = h.find_section(names[i]);
        REQUIRE(s);
        CHECK(s->name == names[i]);
        CHECK(s->offset == h.section(i).offset);
        CHECK(s->shape == std::vector<std::uint64_t>{i % 3 + 1});
        CHECK(ck::get_u64(f.data() + s->offset) == i);
    }
    for (const char* absent :
         {"", "0", "a.", "a.b.c.d", "c", "param.t", "param.t0", "state.t1", "param.t2000", "zzz"})
        CHECK_FALSE(h.find_section(absent));

    // The first repeated name in section order is the one named.
    ck::file_builder d;
    const std::vector<float> one = {1};
    for (const std::string& n : names)
        d.section<float>(n, {1}, one);
    d.section<float>("param.t1999", {1}, one);
    d.section<float>("a.b", {1}, one);
    CHECK_THROWS_WITH(d.finish(ck::shard_magic),
                      Catch::Contains("two sections are named 'param.t1999': give the tensors "
                                      "distinct names"));
}
