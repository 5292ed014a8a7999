// lockstep/train/detail/checkpoint_layout.hpp: where each parameter lay in the flat buffer of
// the run that saved a checkpoint shard, and a flat optimizer buffer moved from that layout
// into the trainer's (a network that registers its tensors in another order).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/checkpoint_parser.hpp"
#include "lockstep/train/parameter_registry.hpp"

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace lockstep::detail::ckpt {

/// Where a parameter lay in the flat buffer of the run that saved a shard.
struct saved_place {
    std::string name; ///< the tensor's (its section's name without "param.")
    std::size_t offset = 0;
    std::size_t size = 0;
};

/// The flat buffer's layout in the run that saved the shard h: its `param.<name>` sections in
/// table order, which is registration order, one after another without padding, as the
/// registry lays out its tensors (visitor networks too). requires: h's parameter sections hold
/// T elements (check_shard's comparison with the trainer ensures it).
template <class T>
std::vector<saved_place> saved_layout(const parsed_header& h) {
    std::vector<saved_place> out;
    std::size_t offset = 0;
    for (std::size_t i = 0; i < h.section_count(); ++i) {
        const section_entry e = h.section(i);
        if (e.name.rfind("param.", 0) != 0)
            continue;
        const auto size = static_cast<std::size_t>(e.length / sizeof(T));
        out.push_back({e.name.substr(6), offset, size});
        offset += size;
    }
    return out;
}

/// The first parameter whose position in the saved layout differs from its position in the
/// trainer's registry (`current`), with both positions and element ranges; empty when every
/// parameter is where it was (then the flat buffers have the same layout).
inline std::string moved_parameter(const std::vector<tensor_info>& current,
                                   const std::vector<saved_place>& saved) {
    for (std::size_t i = 0; i < current.size() && i < saved.size(); ++i) {
        const tensor_info& t = current[i];
        if (t.name == saved[i].name)
            continue;
        std::size_t j = 0;
        while (j < saved.size() && saved[j].name != t.name)
            ++j;
        if (j == saved.size())
            return {}; // a missing section: compare_header reports it
        return concat("parameter '", t.name, "' was registered at position ", j,
                      " by the run that saved the checkpoint (elements [", saved[j].offset, ", ",
                      saved[j].offset + saved[j].size, ") of the flat buffer) and at position ", i,
                      " by this trainer (elements [", t.offset, ", ", t.offset + t.size, "))");
    }
    return {};
}

/// The flat optimizer buffer v, saved in the layout `saved`, in the layout of `current`: each
/// parameter's elements moved from its saved offset to its current one. requires: the same
/// parameters with the same sizes in both (check_shard), v.size() their total.
template <class T>
std::vector<T> to_current_layout(const std::vector<T>& v, const std::vector<saved_place>& saved,
                                 const std::vector<tensor_info>& current) {
    std::unordered_map<std::string_view, const saved_place*> at;
    for (const saved_place& p : saved)
        at.emplace(p.name, &p);
    std::vector<T> out(v.size());
    for (const tensor_info& t : current) {
        const saved_place& p = *at.at(t.name);
        std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(p.offset), t.size,
                    out.begin() + static_cast<std::ptrdiff_t>(t.offset));
    }
    return out;
}

} // namespace lockstep::detail::ckpt
