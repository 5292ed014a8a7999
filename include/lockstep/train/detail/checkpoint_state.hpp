// lockstep/train/detail/checkpoint_state.hpp: the sections a checkpoint holds of a trainer,
// building a shard, checking one against a trainer (metadata: checkpoint_metadata.hpp) and
// restoring it.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/crc32c.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/finite.hpp"
#include "lockstep/core/float16.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "lockstep/train/detail/agreement.hpp"
#include "lockstep/train/detail/checkpoint_access.hpp"
#include "lockstep/train/detail/checkpoint_coverage.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"
#include "lockstep/train/detail/checkpoint_layout.hpp"
#include "lockstep/train/detail/checkpoint_marker.hpp"
#include "lockstep/train/detail/checkpoint_metadata.hpp"
#include "lockstep/train/detail/checkpoint_parser.hpp"
#include "lockstep/train/detail/host_collective.hpp"
#include "lockstep/train/detail/optimizer_shard.hpp"
#include "lockstep/train/detail/parameter_loads.hpp"
#include "lockstep/train/detail/signature.hpp"
#include "lockstep/train/detail/snapshot_staging.hpp"
#include "lockstep/train/detail/trainer_base.hpp"
#include "lockstep/train/detail/visitor.hpp"
#include "lockstep/train/loss_scaler.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace lockstep {

namespace detail::ckpt {

/// A section a trainer's shard must hold: name, element type and shape.
struct section_spec {
    std::string name;
    dtype type;
    std::vector<std::uint64_t> shape;
};

inline std::vector<std::uint64_t> shape64(const std::vector<std::size_t>& s) {
    return std::vector<std::uint64_t>(s.begin(), s.end());
}
inline std::string shape_text(const std::vector<std::uint64_t>& s) {
    std::string t = "{";
    for (std::size_t i = 0; i < s.size(); ++i) {
        if (i > 0)
            t += ", ";
        t += std::to_string(s[i]);
    }
    return t + "}";
}

inline constexpr std::size_t counter_count = 4; ///< steps, samples, since_average, seed

/// The largest step count a checkpoint may record (2^62): far beyond any run, and far enough
/// from std::int64_t's end that steps() and the schedule's look-ahead (describe_trainer's
/// learning rate at steps + 1000) never overflow.
inline constexpr std::uint64_t max_checkpoint_steps = std::uint64_t{1} << 62;

/// Calls f(spec, span in the trainer's System memory) for every T section of dp in file order:
/// parameters, registry state, visited state, optimizer buffers.
template <class DP, class F>
void for_each_tensor_section(DP& dp, F&& f) {
    using T = typename DP::value_type;
    auto& core = checkpoint_access::core(dp);
    auto& reg = core.registry();
    for (const tensor_info& t : reg.parameters())
        f(section_spec{"param." + t.name, dtype_of<T>(), shape64(t.shape)},
          core.values().subspan(t.offset, t.size));
    for (const tensor_info& t : reg.state_tensors())
        f(section_spec{"state." + t.name, dtype_of<T>(), shape64(t.shape)},
          reg.states().subspan(t.offset, t.size));
    visit_state<T>(core.network(), [&](std::string_view name, std::span<T> s) {
        f(section_spec{"state." + std::string(name), dtype_of<T>(), {s.size()}}, s);
    });
    for (const auto& slot : core.optimizer().state().slots)
        f(section_spec{"optimizer." + std::string(slot.name), dtype_of<T>(), {slot.data.size()}},
          slot.data);
}

/// True for the sections of the optimizer's state buffers ("optimizer.<slot>").
inline bool is_optimizer_slot(std::string_view name) {
    return name.substr(0, 10) == "optimizer." && name != "optimizer.step";
}

/// Why dp cannot take the optimizer state of the shard h (empty: it can). A flat optimizer
/// buffer is moved tensor by tensor into the trainer's layout on restore (to_current_layout),
/// but reduce::sharded keeps each replica's part of it for a range of the flat buffer, which
/// another registration order would scatter over other replicas' shards.
template <class DP>
std::string layout_refusal(DP& dp, const parsed_header& h) {
    if constexpr (DP::reduce_policy_type::shards_optimizer_state) {
        const std::string moved =
            moved_parameter(checkpoint_access::core(dp).registry().parameters(),
                            saved_layout<typename DP::value_type>(h));
        if (!moved.empty())
            return concat(moved, ": ", DP::reduce_policy_type::name(),
                          " keeps each replica's optimizer state for a range of the flat buffer, "
                          "which another order would move to other replicas; register the "
                          "tensors in the order of the run that saved the checkpoint");
    }
    (void)dp;
    (void)h;
    return {};
}

/// Every section the shard of replica `as` of dp's trainer holds, in file order (with
/// reduce::sharded, the optimizer buffers hold that replica's shard).
template <class DP>
std::vector<section_spec> expected_sections(DP& dp, shard_owner as) {
    using T = typename DP::value_type;
    std::vector<section_spec> out;
    const std::size_t n = checkpoint_access::core(dp).values().size();
    for_each_tensor_section(dp, [&](section_spec s, std::span<T>) {
        if (DP::reduce_policy_type::shards_optimizer_state && is_optimizer_slot(s.name))
            s.shape = {owned_extent(n, as).count};
        out.push_back(std::move(s));
    });
    out.push_back({"optimizer.step", dtype::i64, {1}});
    out.push_back({"trainer.counters", dtype::u64, {counter_count}});
    if constexpr (has_loss_scaler<DP>)
        out.push_back({"trainer.loss_scale", dtype::f64, {2}});
    return out;
}

/// This replica's shard file before encoding: every section copied out of the system's memory
/// by `staging` (snapshot_staging.hpp: immediate_snapshot for the blocking save), the snapshot a
/// save writes once staging.wait() has returned (encode(shard_magic, ...) or finish(shard_magic)).
template <class DP, class Staging>
file_builder snapshot_shard(DP& dp, Staging& staging) {
    using T = typename DP::value_type;
    check_layer_state_saved(dp, "save_checkpoint");
    auto& core = checkpoint_access::core(dp);
    const auto sys = core.comm().system();
    std::size_t bytes = 0;
    for_each_tensor_section(
        dp, [&](const section_spec&, std::span<T> data) { bytes += data.size_bytes(); });
    staging.begin(core.comm(), bytes);
    file_builder b;
    for (auto& [k, v] : describe_trainer(dp, core.steps(), own_shard(dp)))
        b.meta(k, v);
    for_each_tensor_section(dp, [&](section_spec s, std::span<T> data) {
        staging.section(b, std::move(s.name), std::move(s.shape), std::span<const T>(data), sys);
    });
    staging.end(sys);
    const std::int64_t opt_step = core.optimizer().step_count();
    b.section<std::int64_t>("optimizer.step", {1}, std::span<const std::int64_t>(&opt_step, 1));
    const std::uint64_t counters[counter_count] = {
        static_cast<std::uint64_t>(core.steps()), core.samples(),
        static_cast<std::uint64_t>(checkpoint_access::since_average(dp)), core.context().seed()};
    b.section<std::uint64_t>("trainer.counters", {counter_count},
                             std::span<const std::uint64_t>(counters));
    if constexpr (has_loss_scaler<DP>) {
        // {scale of the next step, growth tracker} (scale 1, tracker 0 without loss scaling).
        const loss_scaler_state st = dp.scaler().state();
        const double v[2] = {st.scale, static_cast<double>(st.growth_tracker)};
        b.section<double>("trainer.loss_scale", {2}, std::span<const double>(v));
    }
    return b;
}

/// A validated shard: its bytes and header.
struct loaded_shard {
    std::vector<std::byte> bytes;
    parsed_header header; ///< views bytes
};

/// Appends to `problems` (each prefixed by `prefix`) every difference between a shard's header
/// h and what the trainer writes: metadata `expected` and sections `want`. A header without
/// "frozen" (a checkpoint written before it was recorded) is not compared on it.
inline void compare_header(const parsed_header& h, const meta_list& expected,
                           const std::vector<section_spec>& want, const std::string& prefix,
                           std::vector<std::string>& problems) {
    for (const auto& [k, v] : expected) {
        const auto got = h.find_meta(k);
        if (!got && k == "frozen")
            continue; // written before checkpoints recorded the frozen set: any set loads
        if (!got)
            problems.push_back(concat(prefix, k, ": missing in the checkpoint (trainer: ", v, ")"));
        else if (*got != v)
            problems.push_back(prefix + setting_refusal(k, *got, v));
    }
    for (std::size_t i = 0; i < h.meta_count(); ++i) {
        const auto [k, v] = h.meta(i);
        bool known = false;
        for (const auto& e : expected)
            known = known || e.first == k;
        if (!known)
            problems.push_back(
                concat(prefix, k, ": ", v, " in the checkpoint, unknown to the trainer"));
    }
    for (const section_spec& s : want) {
        const auto got = h.find_section(s.name);
        if (!got)
            problems.push_back(concat(prefix, "section '", s.name, "' (", dtype_name(s.type), " ",
                                      shape_text(s.shape), ") is missing"));
        else if (got->type != s.type || got->shape != s.shape)
            problems.push_back(concat(prefix, "section '", s.name, "': checkpoint ",
                                      dtype_name(got->type), " ", shape_text(got->shape),
                                      ", trainer ", dtype_name(s.type), " ", shape_text(s.shape)));
    }
    // A set, not a scan of `want` per section: a shard holds a section per tensor.
    std::unordered_set<std::string_view> wanted;
    for (const section_spec& s : want)
        wanted.insert(s.name);
    for (std::size_t i = 0; i < h.section_count(); ++i) {
        if (wanted.contains(h.section_name(i)))
            continue;
        const section_entry e = h.section(i);
        problems.push_back(concat(prefix, "section '", e.name, "' (", dtype_name(e.type), " ",
                                  shape_text(e.shape), ") is not part of this trainer"));
    }
}

/// Parses the shard held in out.bytes (read from `file`, written by replica `as`) and appends to
/// `problems` every difference from what dp's trainer would write as that replica: corrupted
/// sections, metadata (policies, optimizer, schedule at the resume step...), sections'
/// presence, type and shape, the ranges of the counters (steps at most max_checkpoint_steps;
/// steps since the last average below local SGD's K, 0 for the other trainers), of the
/// optimizer's step count (not negative) and of the loss scale: restore() cannot fail then.
template <class DP>
void check_shard(DP& dp, const std::filesystem::path& file, shard_owner as, loaded_shard& out,
                 std::vector<std::string>& problems) {
    auto& core = checkpoint_access::core(dp);
    const int rank = core.comm().rank();
    const std::string shard_what = "shard '" + file.string() + "'";
    out.header = parse_header(out.bytes, shard_magic, shard_what, rank);
    for (std::string& p : verify_sections(out.bytes, out.header))
        problems.push_back(shard_what + ": " + std::move(p));
    if (!problems.empty())
        return;

    // The position the file resumes at (for the schedule check): read only when well-formed
    // and in range, as the steps since the last average.
    std::int64_t steps = core.steps();
    if (const auto c = out.header.find_section("trainer.counters");
        c && c->type == dtype::u64 && c->length == 8 * counter_count) {
        using sync_type = typename DP::sync_policy_type;
        const std::uint64_t saved_steps = get_u64(out.bytes.data() + c->offset);
        const std::uint64_t since = get_u64(out.bytes.data() + c->offset + 16);
        if (saved_steps <= max_checkpoint_steps)
            steps = static_cast<std::int64_t>(saved_steps);
        else
            problems.push_back(concat("section 'trainer.counters': step count ", saved_steps,
                                      " is above the limit ", max_checkpoint_steps));
        if constexpr (is_local_sgd_v<sync_type>) {
            if (since >= sync_type::period)
                problems.push_back(concat("section 'trainer.counters': ", since,
                                          " step(s) since the last average, ", sync_type::name(),
                                          " averages every ", sync_type::period, " steps"));
        } else if (since != 0) {
            problems.push_back(concat("section 'trainer.counters': ", since,
                                      " step(s) since the last average, ", sync_type::name(),
                                      " does not average (must be 0)"));
        }
    }
    if (const auto e = out.header.find_section("optimizer.step");
        e && e->type == dtype::i64 && e->length == 8) {
        // load_state refuses a negative count: refused here, before restore() copies anything.
        if (const auto v = static_cast<std::int64_t>(get_u64(out.bytes.data() + e->offset)); v < 0)
            problems.push_back(concat("section 'optimizer.step': step count ", v, " is negative"));
    }
    if constexpr (is_asynchronous_v<typename DP::sync_policy_type>) {
        // Any server of the run that saved is taken (its shard is the one restored): the value
        // is checked for range instead of equality.
        if (const auto r = out.header.find_meta("async.root"); r && as.async_root < 0) {
            const auto v = parse_decimal(*r);
            if (!v || *v >= static_cast<std::uint64_t>(as.world_size))
                problems.push_back(concat("async.root: checkpoint ", quote_value(*r),
                                          " is not a replica of the ", as.world_size,
                                          " that saved it"));
            else
                as.async_root = static_cast<int>(*v);
        }
    }
    meta_list expected;
    try {
        expected = describe_trainer(dp, steps, as);
    } catch (const error& e) { // the schedule threw at the resume step: e names it
        problems.push_back(e.details());
        expected = describe_trainer(dp, core.steps(), as);
    }
    compare_header(out.header, expected, expected_sections(dp, as), "", problems);
    if (problems.empty())
        if (std::string p = layout_refusal(dp, out.header); !p.empty())
            problems.push_back(std::move(p));
    if constexpr (has_loss_scaler<DP>) {
        // The loss scale's state is checked here, so that restoring it cannot fail half-way.
        const auto e = out.header.find_section("trainer.loss_scale");
        if (problems.empty() && e && e->type == dtype::f64 && e->length == 16) {
            double v[2];
            std::memcpy(v, out.bytes.data() + e->offset, sizeof v);
            const auto& sc = dp.scaler();
            const double interval =
                sc.enabled() ? static_cast<double>(sc.config().growth_interval) : 1.0;
            const bool ok = is_finite(v[0]) && v[0] > 0 && (sc.enabled() || v[0] == 1.0) &&
                            v[1] >= 0 && v[1] < interval && v[1] == std::floor(v[1]);
            if (!ok)
                problems.push_back(concat("section 'trainer.loss_scale': scale ", v[0],
                                          ", growth tracker ", v[1], " out of range"));
        }
    }
}

template <class E>
std::vector<E> section_values(const loaded_shard& s, std::string_view name) {
    const auto e = s.header.find_section(name);
    std::vector<E> v(e->length / sizeof(E));
    std::memcpy(v.data(), s.bytes.data() + e->offset, e->length);
    return v;
}

/// Writes a validated shard into the trainer. `slots`: when not null, the optimizer's buffers
/// (in state().slots order) instead of the shard's (a resharded optimizer state).
template <class DP>
void restore(DP& dp, const loaded_shard& s,
             const std::vector<std::vector<typename DP::value_type>>* slots = nullptr) {
    using T = typename DP::value_type;
    auto& core = checkpoint_access::core(dp);
    const auto sys = core.comm().system();
    const std::vector<tensor_info>& params = core.registry().parameters();
    const std::vector<saved_place> layout = saved_layout<T>(s.header);
    // Parameters, state and counters are restored by name; a flat optimizer buffer (unsharded:
    // one element per parameter element) follows its parameters when they were registered in
    // another order (sharded state is refused then: layout_refusal).
    const bool moved =
        !DP::reduce_policy_type::shards_optimizer_state && !moved_parameter(params, layout).empty();
    std::size_t next_slot = 0;
    for_each_tensor_section(dp, [&](const section_spec& spec, std::span<T> data) {
        if (slots && is_optimizer_slot(spec.name)) {
            copy(std::span<const T>((*slots)[next_slot++]), host_system{1}, data, sys);
            return;
        }
        std::vector<T> h = section_values<T>(s, spec.name);
        if (moved && is_optimizer_slot(spec.name) && h.size() == core.values().size())
            h = to_current_layout(h, layout, params);
        copy(std::span<const T>(h), host_system{1}, data, sys);
    });
    // The values are in the flat buffer; the visitor's network gets them as after a step.
    core.unpack_values();
    auto& opt = core.optimizer();
    const auto view = opt.state();
    state_view<const T> saved{section_values<std::int64_t>(s, "optimizer.step")[0], {}};
    for (const auto& slot : view.slots)
        saved.slots.push_back({slot.name, std::span<const T>(slot.data)});
    opt.load_state(saved);
    const auto c = section_values<std::uint64_t>(s, "trainer.counters");
    core.restore_position(static_cast<std::int64_t>(c[0]), c[1], c[3]);
    checkpoint_access::forget_last_step(dp);
    if constexpr (has_loss_scaler<DP>) {
        const auto v = section_values<double>(s, "trainer.loss_scale");
        dp.scaler().restore({v[0], static_cast<std::int64_t>(v[1])});
    }
    checkpoint_access::set_since_average(dp, static_cast<std::size_t>(c[2]));
    if constexpr (requires { core.comm().synchronize(); })
        core.comm().synchronize();
    parameter_loads.fetch_add(1, std::memory_order_relaxed); // compute_copy casts again
}

} // namespace detail::ckpt

} // namespace lockstep
