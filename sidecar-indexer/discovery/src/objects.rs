//! A local copy of one watched Kubernetes collection, with list/watch semantics and no I/O.
//!
//! The API server delivers a collection as a list followed by watch events, and after a lost watch
//! (HTTP 410 Gone, a restart) as a fresh re-list. [`ObjectSet`] keeps the last *complete* view:
//! objects listed during a re-list are buffered and swap in atomically when the list ends, so a
//! half-finished re-list never looks like pods disappearing. Objects missing from a completed
//! re-list are gone, exactly as kube-runtime's watcher documents for `InitDone`.

use std::collections::BTreeMap;

use kube::Resource;

/// One step of a list/watch, independent of the client library (the watcher converts
/// kube-runtime's `Event` into this; tests convert recorded API responses).
#[derive(Debug, Clone, PartialEq)]
pub enum ObjectEvent<K> {
    /// A (re-)list starts.
    ListStart,
    /// An object of the running list.
    Listed(K),
    /// The list is complete: it replaces the previous view.
    ListDone,
    /// Watch: an object was added or modified.
    Applied(K),
    /// Watch: an object was deleted.
    Deleted(K),
}

/// The latest complete view of a collection, keyed by object name.
#[derive(Debug, Clone)]
pub struct ObjectSet<K> {
    current: BTreeMap<String, K>,
    relist: Option<BTreeMap<String, K>>,
    synced: bool,
}

impl<K> Default for ObjectSet<K> {
    fn default() -> Self {
        Self { current: BTreeMap::new(), relist: None, synced: false }
    }
}

impl<K: Resource> ObjectSet<K> {
    /// Applies one event. Returns whether the complete view changed (callers recompute then).
    /// Objects without a name are ignored: the API server never sends them.
    pub fn apply(&mut self, event: ObjectEvent<K>) -> bool {
        match event {
            ObjectEvent::ListStart => {
                self.relist = Some(BTreeMap::new());
                false
            }
            ObjectEvent::Listed(obj) => {
                if let (Some(buf), Some(name)) = (self.relist.as_mut(), name_of(&obj)) {
                    buf.insert(name, obj);
                }
                false
            }
            ObjectEvent::ListDone => {
                // A ListDone without ListStart (cannot happen with kube's watcher) keeps the view.
                if let Some(buf) = self.relist.take() {
                    self.current = buf;
                }
                self.synced = true;
                true
            }
            ObjectEvent::Applied(obj) => {
                let Some(name) = name_of(&obj) else { return false };
                self.current.insert(name, obj);
                self.synced
            }
            ObjectEvent::Deleted(obj) => {
                let Some(name) = name_of(&obj) else { return false };
                self.current.remove(&name).is_some() && self.synced
            }
        }
    }

    /// Whether a first list has completed (before that the view is not trustworthy).
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Objects in name order.
    pub fn iter(&self) -> impl Iterator<Item = &K> {
        self.current.values()
    }

    /// The object called `name`.
    pub fn get(&self, name: &str) -> Option<&K> {
        self.current.get(name)
    }

    /// Number of objects in the view.
    pub fn len(&self) -> usize {
        self.current.len()
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.current.is_empty()
    }
}

fn name_of<K: Resource>(obj: &K) -> Option<String> {
    obj.meta().name.clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(name: &str) -> Pod {
        Pod {
            metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
            ..Pod::default()
        }
    }

    fn names(set: &ObjectSet<Pod>) -> Vec<String> {
        set.iter().filter_map(|p| p.metadata.name.clone()).collect()
    }

    #[test]
    fn relist_swaps_in_atomically() {
        let mut set = ObjectSet::default();
        assert!(!set.synced());
        for ev in
            [ObjectEvent::ListStart, ObjectEvent::Listed(pod("a")), ObjectEvent::Listed(pod("b"))]
        {
            assert!(!set.apply(ev));
        }
        assert!(set.is_empty(), "nothing visible before the list completes");
        assert!(set.apply(ObjectEvent::ListDone));
        assert_eq!(names(&set), ["a", "b"]);

        // A re-list in progress leaves the old view in place …
        set.apply(ObjectEvent::ListStart);
        set.apply(ObjectEvent::Listed(pod("b")));
        assert_eq!(names(&set), ["a", "b"]);
        // … and its completion drops what it did not list.
        assert!(set.apply(ObjectEvent::ListDone));
        assert_eq!(names(&set), ["b"]);
    }

    #[test]
    fn watch_events_update_the_view() {
        let mut set = ObjectSet::default();
        assert!(
            !set.apply(ObjectEvent::Applied(pod("early"))),
            "not synced yet: no change reported"
        );
        set.apply(ObjectEvent::ListStart);
        set.apply(ObjectEvent::ListDone);
        assert!(set.apply(ObjectEvent::Applied(pod("a"))));
        assert!(set.get("a").is_some());
        assert!(set.apply(ObjectEvent::Deleted(pod("a"))));
        assert!(!set.apply(ObjectEvent::Deleted(pod("a"))), "deleting the absent changes nothing");
        assert!(!set.apply(ObjectEvent::Applied(Pod::default())), "nameless objects are ignored");
        assert_eq!(set.len(), 0);
    }
}
