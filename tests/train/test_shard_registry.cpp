// shard() and parameter_registry: the global-batch split and the flat zero-copy storage.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/shard.hpp"

#include <catch2/catch.hpp>

#include <numeric>
#include <string>

using namespace lockstep;

TEST_CASE("shard splits a global batch contiguously, counts differing by at most one",
          "[train][shard]") {
    for (std::size_t global : {0, 1, 3, 4, 37, 100})
        for (int size : {1, 2, 3, 4, 7}) {
            INFO("global " << global << " over " << size);
            std::size_t next = 0;
            std::size_t lo = global, hi = 0;
            for (int r = 0; r < size; ++r) {
                const shard_range s = shard(global, r, size);
                CHECK(s.begin == next);
                CHECK(s.end >= s.begin);
                CHECK(s.global_size == global);
                CHECK(s.scale == (global ? 1.0 / double(global) : 0.0));
                lo = std::min(lo, s.size());
                hi = std::max(hi, s.size());
                next = s.end;
            }
            CHECK(next == global);
            CHECK(hi - lo <= 1);
        }
    // 37 over 4: 10, 9, 9, 9; 3 over 4: the last replica is empty.
    CHECK(shard(37, 0, 4).size() == 10);
    CHECK(shard(37, 3, 4).begin == 28);
    CHECK(shard(3, 3, 4).empty());
    CHECK(shard(3, 2, 4).begin == 2);
    // A sub-range (a micro-batch) keeps absolute positions.
    const shard_range m = shard(10, 20, 1, 3);
    CHECK(m.begin == 14);
    CHECK(m.end == 17);
    CHECK(m.sample_index(15) == 15);
    CHECK_THROWS_WITH(shard(10, 4, 4), Catch::Contains("rank 4 is not a replica of 4"));
    CHECK_THROWS_WITH(shard(5, 4, 0, 1), Catch::Contains("range [5, 4) is reversed"));
}

TEST_CASE("parameter_registry lays tensors out flat in registration order", "[train][registry]") {
    parameter_registry<float> reg(host_system{1}, 3);
    auto w = reg.add("fc.weight", {3, 2});
    auto b = reg.add("fc.bias", {3});
    auto m = reg.add_state("bn.running_mean", {4});
    // Before finalize: staging memory, writable for initialisation.
    std::iota(w.value().begin(), w.value().end(), 1.0f);
    b.value()[2] = 9.0f;
    m.value()[0] = -1.0f;
    CHECK_THROWS_WITH(w.grad(), Catch::Contains("requested before finalize()"));
    reg.finalize();
    REQUIRE(reg.parameter_count() == 9);
    REQUIRE(reg.state_count() == 4);
    CHECK(reg.parameters()[1].offset == 6);
    CHECK(reg.parameters()[1].name == "fc.bias");
    CHECK(reg.parameters()[0].shape == std::vector<std::size_t>{3, 2});
    // Zero copy: the handles' spans are sub-spans of the flat buffers.
    CHECK(w.value().data() == reg.values().data());
    CHECK(b.value().data() == reg.values().data() + 6);
    CHECK(b.grad().data() == reg.grads().data() + 6);
    CHECK(reg.value(m).data() == reg.states().data());
    // Staged values were copied; gradients start at zero.
    CHECK(reg.values()[0] == 1.0f);
    CHECK(reg.values()[5] == 6.0f);
    CHECK(reg.values()[8] == 9.0f);
    CHECK(reg.states()[0] == -1.0f);
    for (float g : reg.grads())
        CHECK(g == 0.0f);
    CHECK(reg.find("fc.bias").valid());
    CHECK_FALSE(reg.find("nope").valid());
    CHECK(shape_string(w.shape()) == "{3, 2}");
}

TEST_CASE("parameter_registry rejects bad declarations with the name and the replica",
          "[train][registry]") {
    parameter_registry<double> reg(host_system{1}, 2);
    reg.add("a", {2});
    try {
        reg.add("a", {3});
        FAIL("duplicate name accepted");
    } catch (const error& e) {
        CHECK(e.replica() == 2);
        CHECK_THAT(e.what(), Catch::Contains("'a' is declared twice"));
    }
    CHECK_THROWS_WITH(reg.add("z", {2, 0}), Catch::Contains("{2, 0}"));
    CHECK_THROWS_WITH(reg.add_state("s", std::vector<std::size_t>{}),
                      Catch::Contains("'s' has shape"));
    auto m = reg.add_state("m", {1});
    CHECK_THROWS_WITH(reg.grad(m), Catch::Contains("'m' is state, it has no gradient"));
    reg.finalize();
    CHECK_THROWS_WITH(reg.add("late", {1}), Catch::Contains("after finalize"));
}

TEST_CASE("parameter_registry finds each of many tensors by name and refuses every duplicate",
          "[train][registry]") {
    parameter_registry<float> reg(host_system{1}, 1);
    constexpr std::size_t n = 3000;
    for (std::size_t i = 0; i < n; ++i) {
        if (i % 3 == 2)
            reg.add_state("t" + std::to_string(i), {1});
        else
            reg.add("t" + std::to_string(i), {i % 5 + 1});
    }
    // A duplicate of either kind, declared as either kind, early or late, is refused.
    for (const char* name : {"t0", "t2", "t1501", "t2999"}) {
        CHECK_THROWS_WITH(reg.add(name, {1}),
                          Catch::Contains(std::string("'") + name + "' is declared twice"));
        CHECK_THROWS_WITH(reg.add_state(name, {1}),
                          Catch::Contains(std::string("'") + name + "' is declared twice"));
    }
    REQUIRE(reg.parameters().size() == 2000);
    REQUIRE(reg.state_tensors().size() == 1000);
    reg.finalize();
    for (std::size_t i = 0; i < n; ++i) {
        const auto h = reg.find("t" + std::to_string(i));
        REQUIRE(h.valid());
        CHECK(h.kind() == (i % 3 == 2 ? tensor_kind::state : tensor_kind::parameter));
        CHECK(h.index() == (i % 3 == 2 ? i / 3 : i - i / 3));
        CHECK(h.name() == "t" + std::to_string(i));
    }
    CHECK_FALSE(reg.find("t").valid());
    CHECK_FALSE(reg.find("t3000").valid());
    CHECK_FALSE(reg.find("t00").valid());
}
