// Pinned bits of every reduce policy and of every exchange of reduce::reproducible, on thread
// replicas: short trainings of the test network (one BN layer, inputs differing per replica,
// global batches that do not divide evenly) whose end state (weights, optimizer state, BN
// running statistics, every step's loss, skip and scale: pinned_bits.hpp) is hashed through the
// public trainer API and compared with a constant recorded from commit 71fda83 (main before the
// step was restructured into one collective per policy). A refactor that claims to change no
// bit must leave every constant as it is.
//
// What the constants depend on: the compiler's floating-point code for the network, the
// reductions and the optimizers. Recorded with clang++ on x86-64 (SSE2 scalar and vector paths:
// no -march, no -ffast-math, FP contraction at clang's default, which emits no FMA without an
// FMA target). They were the same in the host-mpi preset (Release -O3, Thrust OpenMP, with
// OMP_NUM_THREADS=1, 2 and 4) and in the tsan preset (Debug -O0 and, declared OPTIMIZED, -O1;
// -fsanitize=thread; Thrust CPP). Another compiler, -march=native (FMA), -ffast-math or another
// ISA may change them. To re-pin after a deliberate change of the numerics, run
// `LOCKSTEP_PRINT_STEP_BITS=1 ./test_pinned_bits` and paste the printed lines into `pinned`, in
// a commit that says why.
// SPDX-License-Identifier: Apache-2.0
#include "optimizer_cases.hpp"
#include "pinned_bits.hpp"
#include "repro_runner.hpp"

#include "lockstep/comm/hierarchical.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/core/float16.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

using namespace lockstep;
using namespace lockstep_test;

namespace {

// The pinned hashes (see the comment at the top before changing one).
const std::map<std::string, std::uint64_t> pinned = {
    // PINNED-BEGIN
    {"per_tensor sgd R1", 0x18fe266e974f98d3ull},
    {"per_tensor sgd R2", 0x1e74f31ce7c53d7cull},
    {"per_tensor sgd R3", 0xcd1063ec562d02e6ull},
    {"bucketed<256,64> overlap=never sgd R1", 0x18fe266e974f98d3ull},
    {"bucketed<256,64> overlap=never sgd R2", 0x1e74f31ce7c53d7cull},
    {"bucketed<256,64> overlap=never sgd R3", 0xcd1063ec562d02e6ull},
    {"bucketed<256,64> overlap=always sgd R1", 0x18fe266e974f98d3ull},
    {"bucketed<256,64> overlap=always sgd R2", 0x1e74f31ce7c53d7cull},
    {"bucketed<256,64> overlap=always sgd R3", 0xcd1063ec562d02e6ull},
    {"parameter_server<0> sgd R1", 0x18fe266e974f98d3ull},
    {"parameter_server<0> sgd R2", 0x1e74f31ce7c53d7cull},
    {"parameter_server<0> sgd R3", 0xcd1063ec562d02e6ull},
    {"compressed<half> sgd R1", 0xdf8394285ed908adull},
    {"compressed<half> sgd R2", 0x5cfe96bf1b820c56ull},
    {"compressed<half> sgd R3", 0x7ae7a39320836f8cull},
    {"compressed<bfloat16> sgd R1", 0xe9ee14b8fd532d58ull},
    {"compressed<bfloat16> sgd R2", 0xaae455b267f42230ull},
    {"compressed<bfloat16> sgd R3", 0xa0ad87e07bb692beull},
    {"sharded<256,64> uneven adam R1", 0x806347b83bdac9faull},
    {"sharded<256,64> uneven adam R2", 0xa81add2492225b0bull},
    {"sharded<256,64> uneven adam R3", 0xb50545a60c9f12ddull},
    {"sharded<256,64> even adam R1", 0x0908c9566c29bd7aull},
    {"sharded<256,64> even adam R2", 0xee191228c8dfada6ull},
    {"sharded<256,64> even adam R3", 0x15932a4acf1767e5ull},
    {"sharded<256,64> uneven lars R1", 0x98578dada24b1d09ull},
    {"sharded<256,64> uneven lars R2", 0x5307e749baa330b3ull},
    {"sharded<256,64> uneven lars R3", 0x1f69bff8e6ce682bull},
    {"sharded<256,64> uneven lamb R1", 0x91d04d0177ed3961ull},
    {"sharded<256,64> uneven lamb R2", 0x965bb6135f2bf719ull},
    {"sharded<256,64> uneven lamb R3", 0xd1a6cdbd0358691aull},
    {"local_sgd<3> per_tensor bn::local sgd R1", 0x18fe266e974f98d3ull},
    {"local_sgd<3> per_tensor bn::local sgd R2", 0xfed27ceece7e2d2full},
    {"local_sgd<3> per_tensor bn::local sgd R3", 0x00b09920b15c2971ull},
    {"bucketed<256,64> loss_scale(1024, growth 3) adam R1", 0x792ea4463e0f6800ull},
    {"bucketed<256,64> loss_scale(1024, growth 3) adam R2", 0x37f9d8bef15f0c1full},
    {"bucketed<256,64> loss_scale(1024, growth 3) adam R3", 0xad303627ec1dc151ull},
    {"bucketed<256,64> max_grad_norm=0.05 sgd R1", 0x6131229decf20107ull},
    {"bucketed<256,64> max_grad_norm=0.05 sgd R2", 0x3e4758f947dd4d92ull},
    {"bucketed<256,64> max_grad_norm=0.05 sgd R3", 0xcd5681ce83561121ull},
    {"reproducible<8> bn::ghost<8> adam combined R1", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam combined R2", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam combined R3", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam combined R4", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam gathered two_level 1x2", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam blocks two_level 1x2", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam gathered two_level 2x1", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam blocks two_level 2x1", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam gathered two_level 2x2", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam blocks two_level 2x2", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam gathered two_level 3x1", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam blocks two_level 3x1", 0x4e3404b3fa434370ull},
    {"reproducible<8> bn::ghost<8> adam gathered+blocks two_level 2x2", 0x4e3404b3fa434370ull},
    // PINNED-END
};

/// 66 parameters (in 4, hidden 8, out 2): even shards over 1, 2 and 3 replicas; the default
/// shape's 83 are uneven over 2 and 3.
constexpr mlp_shape even_shape{.in = 4, .hidden = 8, .out = 2};

using sgd_t = sgd_case<float>;
using adam_t = adam_case<float>;
using small_buckets = reduce::bucketed<256, 64>; // 64 floats, 16 first: several buckets launch
using small_shards = reduce::sharded<256, 64>;

/// Every replica's bits of one run on `replicas` thread replicas.
template <class Opt, class Sync, class Reduce, class BN = bn::global>
std::vector<replica_bits> thread_run(int replicas, const bits_options& o,
                                     typename Opt::params_type op) {
    std::vector<replica_bits> out(static_cast<std::size_t>(replicas));
    thread_group group(replicas);
    group.run([&](thread_communicator& comm) {
        out[static_cast<std::size_t>(comm.rank())] =
            hashed_run<float, Opt, Sync, Reduce, BN>(comm, o, op);
    });
    return out;
}

/// Every replica holds the bits replica 0 holds (independent of the pinned constants).
void check_agreement(const std::vector<replica_bits>& r) {
    for (std::size_t k = 1; k < r.size(); ++k) {
        INFO("replica " << k);
        CHECK(r[k].common == r[0].common);
    }
}

/// The pinned check of one configuration at 1, 2 and 3 thread replicas; every run's bits.
template <class Opt, class Sync, class Reduce, class BN = bn::global>
std::vector<std::vector<replica_bits>> each_count(const std::string& name, bits_options o,
                                                  typename Opt::params_type op) {
    if (o.batches.empty())
        o.batches = pinned_schedule();
    std::vector<std::vector<replica_bits>> out;
    for (int replicas : {1, 2, 3}) {
        out.push_back(thread_run<Opt, Sync, Reduce, BN>(replicas, o, op));
        check_pinned(pinned, name + " R" + std::to_string(replicas),
                     combine_bits<Reduce, is_local_sgd_v<Sync>>(out.back()));
        if constexpr (!is_local_sgd_v<Sync>)
            check_agreement(out.back());
    }
    return out;
}

} // namespace

TEST_CASE("pinned bits: per_tensor", "[train][thread][bits]") {
    each_count<sgd_t::type, sync::synchronous, reduce::per_tensor>("per_tensor sgd", {},
                                                                   sgd_t::params());
}

TEST_CASE("pinned bits: bucketed, inline and overlapped", "[train][thread][bits]") {
    for (const overlap_mode mode : {overlap_mode::never, overlap_mode::always}) {
        bits_options o;
        o.tp.overlap = mode;
        const std::string name = std::string("bucketed<256,64> overlap=") +
                                 (mode == overlap_mode::never ? "never" : "always") + " sgd";
        for (const auto& run :
             each_count<sgd_t::type, sync::synchronous, small_buckets>(name, o, sgd_t::params())) {
            // Several buckets launch (83 floats in buckets of 16, then 64), overlapped or not
            // as asked.
            CHECK(run[0].buckets >= 2);
            CHECK(run[0].overlaps == (mode == overlap_mode::always));
        }
    }
}

TEST_CASE("pinned bits: parameter_server", "[train][thread][bits]") {
    each_count<sgd_t::type, sync::synchronous, reduce::parameter_server<0>>(
        "parameter_server<0> sgd", {}, sgd_t::params());
}

TEST_CASE("pinned bits: compressed half and bfloat16", "[train][thread][bits]") {
    each_count<sgd_t::type, sync::synchronous, reduce::compressed<lockstep::half>>(
        "compressed<half> sgd", {}, sgd_t::params());
    each_count<sgd_t::type, sync::synchronous, reduce::compressed<lockstep::bfloat16>>(
        "compressed<bfloat16> sgd", {}, sgd_t::params());
}

TEST_CASE("pinned bits: sharded, even and uneven shards, adam, lars, lamb",
          "[train][thread][bits]") {
    each_count<adam_t::type, sync::synchronous, small_shards>("sharded<256,64> uneven adam", {},
                                                              adam_t::params());
    bits_options even;
    even.shape = even_shape;
    each_count<adam_t::type, sync::synchronous, small_shards>("sharded<256,64> even adam", even,
                                                              adam_t::params());
    each_count<lars_case<float>::type, sync::synchronous, small_shards>(
        "sharded<256,64> uneven lars", {}, lars_case<float>::params());
    each_count<lamb_case<float>::type, sync::synchronous, small_shards>(
        "sharded<256,64> uneven lamb", {}, lamb_case<float>::params());
}

TEST_CASE("pinned bits: local_sgd<3>, ending mid-period", "[train][thread][bits]") {
    // 8 steps: averages after steps 3 and 6, finish() after step 8.
    each_count<sgd_t::type, sync::local_sgd<3>, reduce::per_tensor, bn::local>(
        "local_sgd<3> per_tensor bn::local sgd", {}, sgd_t::params());
}

TEST_CASE("pinned bits: loss scaling and clipping", "[train][thread][bits]") {
    bits_options scaled;
    scaled.tp.loss_scale = loss_scaling{.init_scale = 1024.0, .growth_interval = 3};
    each_count<adam_t::type, sync::synchronous, small_buckets>(
        "bucketed<256,64> loss_scale(1024, growth 3) adam", scaled, adam_t::params());
    bits_options clipped;
    clipped.tp.max_grad_norm = 0.05;
    each_count<sgd_t::type, sync::synchronous, small_buckets>(
        "bucketed<256,64> max_grad_norm=0.05 sgd", clipped, sgd_t::params());
}

// --- reduce::reproducible: every exchange of train/detail/anchored_accumulator.hpp -----------
//
// Which exchange ran is read from dp.collectives() after each step (the accumulator's count of
// a step's collectives, anchored_accumulator::collectives()): combined 2; gathered 1; blocks
// (in place or not) max_calls + 2 (max_calls all_to_alls, the blocks' all_gather, the rows'
// all_gather: loss terms, tail values and the sums' reports). Which one a communicator takes: the
// thread group has all_combine (combined, whatever GatherValues);
// hierarchical_communicator<thread, thread> has all_to_all but neither all_combine nor
// all_to_all_others (gathered when replicas x max_calls x parameters <= GatherValues, else
// blocks, not in place); MPI has all_to_all_others (gathered, else blocks in place:
// test_pinned_bits_mpi.cpp).

namespace {

using two_level = hierarchical_communicator<thread_communicator, thread_communicator>;
constexpr std::size_t repro_params = 83; // the default shape's

enum class exchange { combined, gathered, blocks };

/// The collectives of one step of reduce::reproducible<8, gather_values> on `replicas`.
std::size_t step_collectives(exchange e, std::size_t batch, std::size_t replicas,
                             std::size_t gather_values) {
    const std::size_t chunks = (batch + repro_chunk - 1) / repro_chunk;
    const std::size_t max_calls = (chunks + replicas - 1) / replicas;
    if (e == exchange::combined)
        return 2;
    if (replicas * max_calls * repro_params <= gather_values)
        return 1;
    return max_calls + 2;
}

/// Checks that every step of a run took the exchange `e` (or gathered, where its size allows).
void check_exchange(const std::vector<replica_bits>& r, exchange e, std::size_t gather_values,
                    std::size_t expect_gathered, std::size_t expect_blocks) {
    const auto batches = pinned_schedule();
    std::size_t gathered = 0, blocks = 0;
    for (const replica_bits& b : r) {
        REQUIRE(b.collectives.size() == batches.size());
        for (std::size_t s = 0; s < batches.size(); ++s) {
            const std::size_t issued = b.collectives[s] - (s == 0 ? 0 : b.collectives[s - 1]);
            const std::size_t want = step_collectives(e, batches[s], r.size(), gather_values);
            INFO("step " << s << " of " << r.size() << " replicas");
            CHECK(issued == want);
            if (&b == &r[0]) {
                gathered += e != exchange::combined && want == 1 ? 1 : 0;
                blocks += want > 2 ? 1 : 0;
            }
        }
    }
    CHECK(gathered == expect_gathered);
    CHECK(blocks == expect_blocks);
}

using repro_mixed = reduce::reproducible<repro_chunk, 400>;

template <class Reduce>
std::vector<replica_bits> repro_on_threads(int replicas) {
    return thread_run<adam_t::type, sync::synchronous, Reduce, repro_bn>(
        replicas, {.batches = pinned_schedule()}, adam_t::params());
}

template <class Reduce>
std::vector<replica_bits> repro_two_level(int nodes, int local) {
    std::vector<replica_bits> out(static_cast<std::size_t>(nodes * local));
    thread_group group(nodes * local);
    group.run([&](thread_communicator& world) {
        two_level comm(world.split(world.rank() / local, world.rank()),
                       world.split(world.rank() % local, world.rank()));
        out[static_cast<std::size_t>(comm.rank())] =
            hashed_run<float, adam_t::type, sync::synchronous, Reduce, repro_bn>(
                comm, {.batches = pinned_schedule()}, adam_t::params());
    });
    return out;
}

const std::string repro_name = "reproducible<8> bn::ghost<8> adam";

} // namespace

TEST_CASE("pinned bits: reproducible, combined on the thread group, 1 to 4 replicas",
          "[train][thread][bits][reproducible]") {
    std::vector<std::uint64_t> hashes;
    for (int replicas : {1, 2, 3, 4}) {
        const auto r = repro_on_threads<repro_reduce>(replicas);
        check_exchange(r, exchange::combined, repro_reduce::gather_values, 0, 0);
        check_pinned(pinned, repro_name + " combined R" + std::to_string(replicas),
                     combine_bits<repro_reduce>(r));
        check_agreement(r);
        hashes.push_back(combine_bits<repro_reduce>(r));
    }
    // GatherValues 0 does not change the thread group's exchange.
    const auto r = repro_on_threads<repro_blocks>(3);
    check_exchange(r, exchange::combined, 0, 0, 0);
    hashes.push_back(combine_bits<repro_blocks>(r));
    // The policy's promise, independent of the pinned constants: the same bits at every count.
    for (std::size_t k = 1; k < hashes.size(); ++k)
        CHECK(hashes[k] == hashes[0]);
}

TEST_CASE("pinned bits: reproducible, gathered and blocks over a two-level communicator",
          "[train][thread][bits][reproducible]") {
    const auto reference = combine_bits<repro_reduce>(repro_on_threads<repro_reduce>(1));
    const int shapes[][2] = {{1, 2}, {2, 1}, {2, 2}, {3, 1}};
    for (const auto& shape : shapes) {
        const int nodes = shape[0], local = shape[1];
        const std::string suffix =
            " two_level " + std::to_string(nodes) + "x" + std::to_string(local);
        CAPTURE(nodes, local);
        const auto gathered = repro_two_level<repro_reduce>(nodes, local);
        check_exchange(gathered, exchange::gathered, repro_reduce::gather_values, 8, 0);
        check_pinned(pinned, std::string(repro_name).append(" gathered").append(suffix),
                     combine_bits<repro_reduce>(gathered));
        CHECK(combine_bits<repro_reduce>(gathered) == reference);
        check_agreement(gathered);

        const auto blocks = repro_two_level<repro_blocks>(nodes, local);
        check_exchange(blocks, exchange::blocks, 0, 0, 8);
        check_pinned(pinned, std::string(repro_name).append(" blocks").append(suffix),
                     combine_bits<repro_blocks>(blocks));
        CHECK(combine_bits<repro_blocks>(blocks) == reference);
        check_agreement(blocks);
    }
    // GatherValues 400 at 2 x 2 replicas: the steps whose busiest replica has 1 chunk gather
    // (4 x 1 x 83 = 332 values), those with 2 exchange blocks (664), in one run.
    const auto mixed = repro_two_level<repro_mixed>(2, 2);
    check_exchange(mixed, exchange::blocks, 400, 5, 3);
    check_pinned(pinned, repro_name + " gathered+blocks two_level 2x2",
                 combine_bits<repro_mixed>(mixed));
    CHECK(combine_bits<repro_mixed>(mixed) == reference);
}
