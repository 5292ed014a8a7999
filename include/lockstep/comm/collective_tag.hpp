// lockstep/comm/collective_tag.hpp: collective_tag, the identity of one collective call (a
// caller-chosen name, and the call site) that verified collectives compare across replicas.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/detail/fnv1a.hpp"
#include "lockstep/core/error.hpp"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

namespace lockstep {

/// A place in the source: the file and line of a collective call. Filled in by the compiler
/// (__builtin_FILE/__builtin_LINE, which GCC, Clang and nvcc evaluate at the caller of a
/// function whose default argument they are).
struct call_site {
    const char* file = "";
    int line = 0; ///< int: what __builtin_LINE() returns (no narrowing in the default argument)

    /// The file's last path component ("train.cpp"): what messages show and hashes read.
    constexpr std::string_view file_name() const noexcept {
        const std::string_view f = file == nullptr ? std::string_view() : std::string_view(file);
        const auto slash = f.find_last_of("/\\");
        return slash == std::string_view::npos ? f : f.substr(slash + 1);
    }
    /// "train.cpp:42".
    std::string text() const { return std::string(file_name()) + ":" + std::to_string(line); }
};

/// The identity of one collective call. thread_communicator and mpi_communicator (with
/// verification) take it as an optional last argument of every data collective (all_reduce,
/// broadcast, all_gather, reduce, reduce_scatter, all_to_all, barrier) and compare it across
/// replicas at each sequence number, with the collective, element type, count, reduction and
/// root: replicas whose identities differ all throw errc::shape_mismatch naming every replica's
/// call, before any data moves.
///
/// The identity is `name` when the caller gives one ("bucket 3"). Without a name it is the call
/// site, which the default argument records on its own, and it is compared only when the
/// communicator checks call sites (thread_group_params::check_call_sites,
/// mpi_communicator_params::check_call_sites; default: default_check_call_sites(), on in builds
/// without NDEBUG, off with NDEBUG, LOCKSTEP_CHECK_CALL_SITES=1 or 0 overriding both). Call sites
/// are what tell two calls of the same collective and shape apart: without them (and without names)
/// such calls issued in another order, or one skipped, pair with each other and return a wrong
/// value. Checking call sites requires that every replica issues each collective from the same
/// source line (the same binary); code that calls one collective from different lines on different
/// replicas (an `if (rank == 0)` branch on each side) passes the same name on both lines. A wrapper
/// that forwards a collective_tag parameter with its own `= {}` default records its caller's site.
/// requires: name outlives the call (a string literal is the usual case).
struct collective_tag {
    std::string_view name;
    call_site site;

    /// No name; site: the caller's file and line.
    constexpr collective_tag(call_site s = {__builtin_FILE(), __builtin_LINE()}) noexcept
        : site(s) {}
    /// A named call ("bucket 3"); an empty name is no name.
    constexpr collective_tag(std::string_view n,
                             call_site s = {__builtin_FILE(), __builtin_LINE()}) noexcept
        : name(n), site(s) {}
    /// A named call from a string literal ("bucket 3"). requires: n is null-terminated.
    constexpr collective_tag(const char* n, call_site s = {__builtin_FILE(), __builtin_LINE()})
        : name(n == nullptr ? std::string_view() : std::string_view(n)), site(s) {}

    /// True when the identity compared is the call site (no name, and sites are checked).
    constexpr bool by_site(bool check_sites) const noexcept { return name.empty() && check_sites; }

    /// The identity compared across replicas as text: the name, "file.cpp:42" when by_site, or
    /// "" (nothing to compare).
    std::string identity(bool check_sites) const {
        return by_site(check_sites) ? site.text() : std::string(name);
    }

    /// A positive 63-bit FNV-1a hash of the name, 0 for no name.
    constexpr std::int64_t id() const noexcept { return name.empty() ? 0 : hash(name, 0); }

    /// The identity as a positive 63-bit hash (what mpi_communicator exchanges): the name's
    /// hash, else the call site's when by_site (a different seed, so a name never equals a
    /// site), else 0.
    constexpr std::int64_t id(bool check_sites) const noexcept {
        if (!by_site(check_sites))
            return id();
        return hash(site.file_name(),
                    1469598103934665603ull ^ static_cast<std::uint64_t>(site.line));
    }

private:
    static constexpr std::int64_t hash(std::string_view s, std::uint64_t seed) noexcept {
        const auto v = static_cast<std::int64_t>(detail::fnv1a(s, detail::fnv1a_basis ^ seed) >> 1);
        return v == 0 ? 1 : v;
    }
};

/// Whether communicators check call sites when none is configured: the environment variable
/// LOCKSTEP_CHECK_CALL_SITES ("1" on, "0" off); unset, on in builds without NDEBUG (debug builds,
/// where a skipped or swapped collective is most often made, then name its source line) and off
/// with NDEBUG. ensures: throws lockstep::error (errc::invalid_argument) quoting any other value.
inline bool default_check_call_sites() {
    const char* env = std::getenv("LOCKSTEP_CHECK_CALL_SITES"); // NOLINT(concurrency-mt-unsafe)
    if (env == nullptr) {
#ifdef NDEBUG
        return false;
#else
        return true;
#endif
    }
    const std::string_view v(env);
    LOCKSTEP_REQUIRE(v == "0" || v == "1", errc::invalid_argument, -1, "LOCKSTEP_CHECK_CALL_SITES",
                     "'", v, "' is neither 0 nor 1");
    return v == "1";
}

namespace detail {

/// " ('batch_norm.forward_train')" for a named call, " (at train.cpp:42)" for a call site, ""
/// for none: what follows a collective's name in the backends' messages once the replicas
/// agree on its tag.
inline std::string tag_text(std::string_view tag, bool tag_is_site) {
    if (tag.empty())
        return {};
    return tag_is_site ? " (at " + std::string(tag) + ")" : " ('" + std::string(tag) + "')";
}

} // namespace detail

} // namespace lockstep
