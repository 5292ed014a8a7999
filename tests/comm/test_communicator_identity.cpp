// Tests of communicator_identity: unique per object, handed on by a move, never reused; the
// thread communicator's identity() follows its handle. SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/communicator_identity.hpp"
#include "lockstep/comm/thread_group.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <optional>
#include <set>
#include <utility>
#include <vector>

using namespace lockstep;

TEST_CASE("communicator_identity: unique, moved with the object, never reused",
          "[comm][identity]") {
    std::set<std::uint64_t> seen;
    std::optional<communicator_identity> a(std::in_place);
    const std::uint64_t first = a->value();
    CHECK(first != 0);
    seen.insert(first);

    communicator_identity moved(std::move(*a));
    CHECK(moved.value() == first); // the destination is the same communicator
    CHECK(a->value() != first);    // the moved-from one is another
    CHECK(seen.insert(a->value()).second);

    const communicator_identity copy(moved);
    CHECK(seen.insert(copy.value()).second); // a copy is another object

    // Destroyed and rebuilt in the same storage: a new number, never the old one.
    a.reset();
    a.emplace();
    CHECK(seen.insert(a->value()).second);

    communicator_identity assigned;
    const std::uint64_t before = assigned.value();
    assigned = std::move(moved);
    CHECK(assigned.value() == first);
    CHECK(moved.value() != first);  // NOLINT(bugprone-use-after-move): the moved-from identity
    CHECK(moved.value() != before); // NOLINT(bugprone-use-after-move)
}

TEST_CASE("thread_communicator::identity follows the handle", "[comm][identity][thread]") {
    std::vector<std::uint64_t> ids(2), moved_ids(2), from_ids(2), parent_ids(2);
    thread_group(2).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        thread_communicator sub = comm.split(0, comm.rank());
        ids[r] = sub.identity();
        thread_communicator taken(std::move(sub));
        moved_ids[r] = taken.identity();
        parent_ids[r] = comm.identity();
        // Catch2's checks run on the main thread
        from_ids[r] = sub.identity(); // NOLINT(bugprone-use-after-move): the moved-from identity
    });
    CHECK(ids == moved_ids);
    CHECK(from_ids[0] != ids[0]);
    CHECK(from_ids[1] != ids[1]);
    const std::set<std::uint64_t> all{ids[0], ids[1], parent_ids[0], parent_ids[1]};
    CHECK(all.size() == 4); // every replica's handle, parent and split, has its own
}
