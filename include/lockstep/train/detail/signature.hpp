// lockstep/train/detail/signature.hpp: checks that every replica declared the same parameters
// and state (names, shapes, element type), failing on EVERY replica with both descriptions.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/detail/fnv1a.hpp"
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

/// Verifies that every replica declared the same tensors and the same settings ("name<TAB>value"
/// lines, e.g. detail::describe_settings). One all_gather of {hash, counts} when they agree;
/// when they do not, the description lists are gathered too, and every replica throws
/// lockstep::error naming, for each disagreeing replica, the first differing tensor and both
/// descriptions (shape_mismatch), or every differing setting with both values
/// ("global_batch: 24 on replica 0, 23 on replica 2"; invalid_argument when only settings
/// differ).
template <class T, class Communicator>
void verify_same_tensors(Communicator& comm, const std::vector<tensor_info>& params,
                         const std::vector<tensor_info>& state,
                         const std::vector<std::string>& settings = {}) {
    const std::vector<std::string> lines = describe_tensors<T>(params, state);
    std::string text;
    for (const std::string& l : lines)
        text += l + "\n";
    for (const std::string& l : settings)
        text += "setting\t" + l + "\n";
    const std::uint64_t h = fnv1a(text);
    const int ranks = comm.size();
    std::vector<int> mine = {static_cast<int>(static_cast<std::uint32_t>(h)),
                             static_cast<int>(static_cast<std::uint32_t>(h >> 32)),
                             static_cast<int>(params.size()), static_cast<int>(state.size()),
                             static_cast<int>(settings.size())};
    std::vector<int> all(mine.size() * static_cast<std::size_t>(ranks));
    host_all_gather(comm, std::span<const int>(mine), std::span<int>(all));
    bool same = true;
    for (std::size_t r = 1; r < static_cast<std::size_t>(ranks); ++r)
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
    for (std::size_t r = 0; r < lists.size(); ++r) {
        std::string t(static_cast<std::size_t>(lens[r]), '\0');
        std::memcpy(t.data(), gathered.data() + r * words, t.size());
        std::stringstream ss(t);
        std::string line;
        while (std::getline(ss, line))
            lists[r].push_back(line);
    }
    // Split every replica's lines into tensors and settings.
    std::vector<std::vector<std::string>> tensors(lists.size()), sets(lists.size());
    for (std::size_t r = 0; r < lists.size(); ++r)
        for (const std::string& l : lists[r]) {
            if (l.rfind("setting\t", 0) == 0)
                sets[r].push_back(l.substr(8));
            else
                tensors[r].push_back(l);
        }
    std::string msg;
    bool tensors_differ = false;
    for (std::size_t r = 1; r < tensors.size(); ++r) {
        const auto& a = tensors[0];
        const auto& b = tensors[r];
        std::size_t i = 0;
        while (i < a.size() && i < b.size() && a[i] == b[i])
            ++i;
        if (i == a.size() && i == b.size())
            continue;
        if (!tensors_differ)
            msg += " replicas declare different parameters:";
        tensors_differ = true;
        msg += " tensor #" + std::to_string(i) + ": replica 0 declares " +
               (i < a.size() ? readable(a[i]) : std::string("nothing")) + ", replica " +
               std::to_string(r) + " declares " +
               (i < b.size() ? readable(b[i]) : std::string("nothing")) + " (" +
               std::to_string(a.size()) + " vs " + std::to_string(b.size()) + " tensors);";
    }
    auto value_of = [](const std::vector<std::string>& list, const std::string& name,
                       std::string& value) {
        for (const std::string& l : list)
            if (l.compare(0, name.size() + 1, name + "\t") == 0) {
                value = l.substr(name.size() + 1);
                return true;
            }
        return false;
    };
    bool settings_differ = false;
    for (std::size_t r = 1; r < sets.size(); ++r) {
        std::vector<std::string> names;
        for (const auto* list : {&sets[0], &sets[r]})
            for (const std::string& l : *list) {
                const std::string name = l.substr(0, l.find('\t'));
                bool seen = false;
                for (const std::string& n : names)
                    seen = seen || n == name;
                if (!seen)
                    names.push_back(name);
            }
        for (const std::string& name : names) {
            std::string a = "(none)", b = "(none)";
            const bool in_a = value_of(sets[0], name, a);
            const bool in_b = value_of(sets[r], name, b);
            if (in_a == in_b && a == b)
                continue;
            if (!settings_differ)
                msg += " replicas use different settings:";
            settings_differ = true;
            msg.append(" ").append(name).append(": ").append(a).append(" on replica 0, ");
            msg.append(b).append(" on replica ").append(std::to_string(r)).append(";");
        }
    }
    fail(tensors_differ ? errc::shape_mismatch : errc::invalid_argument, comm.rank(),
         "data_parallel: parameter check",
         msg.empty() ? std::string("replicas disagree") : msg.substr(1));
}

} // namespace lockstep::detail
