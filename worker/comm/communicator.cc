#include "worker/comm/communicator.h"

namespace meshtrain::comm {

std::unique_ptr<Communicator> Communicator::SplitAxis(const api::ParallelLayout& layout,
                                                      api::Axis axis) {
  if (size() != layout.world()) {
    throw CommError("splitting on " + std::string(api::AxisName(axis)) + " needs the world (" +
                    std::to_string(layout.world()) + " ranks); group " + group().Describe() +
                    " is not it");
  }
  std::vector<int> members = layout.GroupOf(axis, rank());
  return NewGroup(members, std::string(api::AxisName(axis)) + "{" + api::FormatRanks(members) + "}");
}

}  // namespace meshtrain::comm
