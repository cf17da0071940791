// The standard library builds whose layouts the library's own build shares. Every public header
// includes this, so that a program built otherwise fails to compile rather than reading garbage
// (a function returning a std::vector links whatever its caller's vector looks like: a return
// type is no part of the mangled name).
#pragma once

// The library is built with libstdc++'s usual containers. Its debug mode lays std::vector out
// otherwise, so that a program built with it would read garbage from every struct passed.
#if defined(_GLIBCXX_DEBUG)
#error "diffuserve's API cannot be used with _GLIBCXX_DEBUG: the library is built without it"
#endif

// Nor with libstdc++'s old std::string (_GLIBCXX_USE_CXX11_ABI=0): the library's strings are the
// C++11 ones, and a string field read by such a program (config().dtype, a finish_reason) would
// be read as the other layout, its functions failing to link at best. (The macro comes with any
// standard header, so one is included first.)
#include <cstddef>
#if defined(_GLIBCXX_USE_CXX11_ABI) && !_GLIBCXX_USE_CXX11_ABI
#error "diffuserve's API cannot be used with _GLIBCXX_USE_CXX11_ABI=0: the library is built with the C++11 ABI"
#endif
