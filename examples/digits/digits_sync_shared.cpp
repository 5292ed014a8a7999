// examples/digits/digits_sync_shared.cpp: the sync::synchronous runs of the digits demo with
// --bn running_only and tower0 (shared running statistics); a translation unit of its own to
// spread the instantiations. SPDX-License-Identifier: Apache-2.0
#include "digits_comm.hpp"
#include "digits_run.hpp"

namespace digits {

template <class Comm>
bool run_synchronous_shared_bn(Comm& comm, const options& o, const split_data& d, result& r,
                               std::string& why) {
    namespace bn = lockstep::bn;
    return dispatch<lockstep::sync::synchronous, bn::running_only, bn::tower<0>>(
        comm, o, d, r, why, synchronous_valid{});
}

template bool run_synchronous_shared_bn(DIGITS_COMMUNICATOR&, const options&, const split_data&,
                                        result&, std::string&);

} // namespace digits
