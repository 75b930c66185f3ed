// A std::vector whose resize() leaves new elements unwritten, for index and
// value arrays that the kernels overwrite in full anyway (CSR arrays,
// partial counts).
#ifndef TF_SPARSE_SPLIT_CC_CORE_UNINIT_VECTOR_H_
#define TF_SPARSE_SPLIT_CC_CORE_UNINIT_VECTOR_H_

#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace tf_sparse_split {

// Allocator Base<T> whose value-less construct() default-initialises:
// resize() of a vector of ints or floats leaves the new elements unwritten
// instead of zeroing them (the CSR build overwrites every entry anyway;
// zeroing was a whole extra write pass over the arrays). Base: any
// allocator template (std::allocator; the direct convolution's 64-byte
// aligned one for its packed filters).
template <template <typename> class Base, typename T>
struct DefaultInitOf : Base<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitOf<Base, U>;
  };
  DefaultInitOf() = default;
  template <typename U>
  DefaultInitOf(const DefaultInitOf<Base, U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <typename T>
using DefaultInitAllocator = DefaultInitOf<std::allocator, T>;

// A vector whose resize() does not zero new elements (see above).
template <typename T>
using UninitVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_UNINIT_VECTOR_H_
