// lockstep/train/detail/signature.hpp: checks that every replica declared the same parameters
// and state (names, shapes, element type), failing on EVERY replica with both descriptions.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/host_collective.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <cstdint>
#include <cstring>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace lockstep::detail {

/// The element type's name in signatures: "float", "double" or "<n>-byte".
template <class T>
std::string element_name() {
    if constexpr (std::is_same_v<T, float>)
        return "float";
    else if constexpr (std::is_same_v<T, double>)
        return "double";
    else
        return std::to_string(sizeof(T)) + "-byte";
}

/// One line per tensor: "parameter<TAB>name<TAB>{3, 4}<TAB>float".
template <class T>
std::vector<std::string> describe_tensors(const std::vector<tensor_info>& params,
                                          const std::vector<tensor_info>& state) {
    std::vector<std::string> out;
    for (const auto* list : {&params, &state})
        for (const tensor_info& t : *list)
            out.push_back(std::string(t.kind == tensor_kind::parameter ? "parameter" : "state") +
                          "\t" + t.name + "\t" + shape_string(t.shape) + "\t" + element_name<T>());
    return out;
}

/// FNV-1a, 64 bits.
inline std::uint64_t fnv1a(const std::string& s, std::uint64_t h = 14695981039346656037ull) {
    for (unsigned char c : s)
        h = (h ^ c) * 1099511628211ull;
    return h;
}

/// "parameter 'fc1.weight' with shape {4, 3} (float)" from a description line.
inline std::string readable(const std::string& line) {
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string part;
    while (std::getline(ss, part, '\t'))
        f.push_back(part);
    if (f.size() != 4)
        return "'" + line + "'";
    return f[0] + " '" + f[1] + "' with shape " + f[2] + " (" + f[3] + ")";
}

/// Verifies that every replica declared the same tensors. One all_gather of {hash, counts}
/// when they agree; when they do not, the description lists are gathered too, and every
/// replica throws lockstep::error (shape_mismatch) naming the first differing tensor of each
/// disagreeing replica and both descriptions.
template <class T, class Communicator>
void verify_same_tensors(Communicator& comm, const std::vector<tensor_info>& params,
                         const std::vector<tensor_info>& state) {
    const std::vector<std::string> lines = describe_tensors<T>(params, state);
    std::string text;
    for (const std::string& l : lines)
        text += l + "\n";
    const std::uint64_t h = fnv1a(text);
    const int ranks = comm.size();
    std::vector<int> mine = {static_cast<int>(static_cast<std::uint32_t>(h)),
                             static_cast<int>(static_cast<std::uint32_t>(h >> 32)),
                             static_cast<int>(params.size()), static_cast<int>(state.size())};
    std::vector<int> all(mine.size() * static_cast<std::size_t>(ranks));
    host_all_gather(comm, std::span<const int>(mine), std::span<int>(all));
    bool same = true;
    for (int r = 1; r < ranks; ++r)
        for (std::size_t k = 0; k < mine.size(); ++k)
            same = same && all[r * mine.size() + k] == all[k];
    if (same)
        return;

    // Gather every replica's description text (padded to the longest, 4 chars per int).
    int len = static_cast<int>(text.size());
    std::vector<int> lens(static_cast<std::size_t>(ranks));
    host_all_gather(comm, std::span<const int>(&len, 1), std::span<int>(lens));
    int longest = 0;
    for (int l : lens)
        longest = l > longest ? l : longest;
    const std::size_t words = (static_cast<std::size_t>(longest) + 3) / 4;
    std::vector<int> packed(words, 0);
    std::memcpy(packed.data(), text.data(), text.size());
    std::vector<int> gathered(words * static_cast<std::size_t>(ranks));
    host_all_gather(comm, std::span<const int>(packed), std::span<int>(gathered));
    std::vector<std::vector<std::string>> lists(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
        std::string t(static_cast<std::size_t>(lens[r]), '\0');
        std::memcpy(t.data(), gathered.data() + r * words, t.size());
        std::stringstream ss(t);
        std::string line;
        while (std::getline(ss, line))
            lists[r].push_back(line);
    }
    std::string msg = "replicas declare different parameters:";
    for (int r = 1; r < ranks; ++r) {
        const auto& a = lists[0];
        const auto& b = lists[r];
        std::size_t i = 0;
        while (i < a.size() && i < b.size() && a[i] == b[i])
            ++i;
        if (i == a.size() && i == b.size())
            continue;
        msg += " tensor #" + std::to_string(i) + ": replica 0 declares " +
               (i < a.size() ? readable(a[i]) : std::string("nothing")) + ", replica " +
               std::to_string(r) + " declares " +
               (i < b.size() ? readable(b[i]) : std::string("nothing")) + " (" +
               std::to_string(a.size()) + " vs " + std::to_string(b.size()) + " tensors);";
    }
    fail(errc::shape_mismatch, comm.rank(), "data_parallel: parameter check", msg);
}

} // namespace lockstep::detail
