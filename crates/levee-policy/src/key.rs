//! [`Key`]: a name with its hash computed once, for tenant and model keys.
//!
//! Admission hashes the tenant and model on every decision; with `Arc<str>` keys that is a
//! full string hash and `memcmp` per lookup. A `Key` carries a precomputed 64-bit hash, clones
//! as one `Arc` increment, and compares by pointer first, so lookups cost a few nanoseconds.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use crate::fasthash::FastState;

#[derive(Debug)]
struct Inner {
    hash: u64,
    name: Box<str>,
}

/// An immutable name (tenant, model, backend) with a precomputed hash. Cheap to clone.
#[derive(Clone)]
pub struct Key(Arc<Inner>);

impl Key {
    /// A key for `name`.
    pub fn new(name: &str) -> Self {
        let hash = FastState::default().hash_one(name);
        Key(Arc::new(Inner {
            hash,
            name: name.into(),
        }))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0.name
    }
}

impl std::ops::Deref for Key {
    type Target = str;

    #[inline]
    fn deref(&self) -> &str {
        &self.0.name
    }
}

impl AsRef<str> for Key {
    #[inline]
    fn as_ref(&self) -> &str {
        &self.0.name
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Self {
        Key::new(s)
    }
}

impl From<String> for Key {
    fn from(s: String) -> Self {
        Key::new(&s)
    }
}

impl PartialEq for Key {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.hash == other.0.hash && self.0.name == other.0.name)
    }
}

impl Eq for Key {}

impl Hash for Key {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0.hash);
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.name.cmp(&other.0.name)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0.name, f)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn equal_names_are_equal_keys() {
        let a = Key::new("acme");
        let b = Key::from("acme".to_string());
        assert_eq!(a, b);
        assert_ne!(a, Key::new("acme2"));
        let mut m = HashMap::new();
        m.insert(a.clone(), 1);
        assert_eq!(m.get(&b), Some(&1));
        assert_eq!(a.to_string(), "acme");
        assert!(Key::new("a") < Key::new("b"));
    }
}
